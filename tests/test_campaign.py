"""`tkcc campaign --agent search` end to end, as a subprocess, on the CPU: the report, the plot
and the best sources are written; the ledger holds every experiment; the best candidate is
exact per the ledger and its speedup was measured; SIGKILL mid-run and running again continues
from the ledger (more experiments, same agent ids, candidate ids never reused, the budget
counting what the first run spent); SIGTERM writes the report and stops the engine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_server.ledger import Ledger
from tkcc_mcp import launch

TKCC = [sys.executable, "-m", "tkcc_mcp.cli"]
ENV = os.environ | {"TKCC_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}


def campaign(out: Path, budget: str = "60s", *extra: str) -> list[str]:
    return TKCC + ["campaign", "--agent", "search", "--model", "llama-3.2-1b", "--shrink", "--device", "cpu",
                   "--budget", budget, "--out", str(out), "--agents", "2", *extra]


def submits(out: Path) -> list[dict]:
    db = out / "engine" / "ledger.db"
    return Ledger(db).calls(method="submit_forward_pass") if db.exists() else []


def wait_for(pred, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the campaign exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def out(tmp_path):
    d = tmp_path / "run"
    yield d
    info = d / "engine" / "engine.json"  # never leave an engine behind, whatever failed
    if info.exists():
        launch.stop_engine(json.loads(info.read_text())["pid"])


def engine_pid(out: Path) -> int | None:
    f = out / "engine" / "engine.json"
    return json.loads(f.read_text())["pid"] if f.exists() else None


@pytest.mark.timeout(400)
def test_campaign_report_and_resume_after_sigkill(out):
    t0 = time.monotonic()
    first = subprocess.Popen(campaign(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True)
    wait_for(lambda: len([c for c in submits(out) if c["finished_at"]]) >= 3, 150, "three experiments", first)
    first.kill()  # SIGKILL: no report, no cleanup; the engine (detached) keeps running
    first.wait()
    before = submits(out)
    ids_before = {c["candidate_id"] for c in before}
    spent_before = json.loads((out / "campaign.json").read_text())["spent_s"]
    assert not (out / "report.json").exists()
    pid = engine_pid(out)

    second = subprocess.run(campaign(out), capture_output=True, text=True, env=ENV, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    elapsed = time.monotonic() - t0
    assert "resuming" in second.stderr and "report:" in second.stdout and "speedup_over_time.png" in second.stdout

    state = json.loads((out / "campaign.json").read_text())
    assert len(state["sessions"]) == 2 and state["sessions"][1]["offset_s"] == pytest.approx(spent_before, abs=2)
    rep = json.loads((out / "report.json").read_text())
    # the budget counts the first run; agents stop near it, or before it once every move
    # combination they would try is tried (on a fast host both can run out of moves first)
    exhausted = all(a["status"] == "exhausted" for a in rep["agents"])
    assert (spent_before if exhausted else 60) <= state["spent_s"] <= 60 + 45, (state["spent_s"], rep["agents"])
    led = Ledger(out / "engine" / "ledger.db")
    after = led.calls(method="submit_forward_pass")
    ids_after = [c["candidate_id"] for c in after]
    # more experiments, the same two agents, no candidate id reused
    assert len(after) > len(before) and ids_before <= set(ids_after)
    assert len(ids_after) == len(set(ids_after)) == len(led.candidates())
    assert {c["agent_id"] for c in after} == {"search-expert-0", "search-expert-1"}
    assert {c["agent_id"] for c in after if c["candidate_id"] not in ids_before} == {"search-expert-0",
                                                                                    "search-expert-1"}
    assert max(ids_after) > max(ids_before)
    # every experiment an agent logged is in the ledger, and the report counts them all
    for agent in ("search-expert-0", "search-expert-1"):
        logged = [ln.split()[1] for ln in (out / "agents" / agent / "search.log").read_text().splitlines()
                  if len(ln.split()) > 2 and ln.split()[1].startswith("c0") and "full tier" not in ln]
        assert set(logged) <= set(ids_after)
        assert logged, agent
    assert rep["experiments"] == len(after)
    # the best is exact per the ledger's latest check, and its speedup is a measurement there
    best = rep["best"]
    assert best is not None and (out / "best" / f"1_{best['candidate_id']}.py").exists()
    checks = led.calls(candidate_id=best["candidate_id"], method="check_bit_exact")
    assert checks and checks[-1]["result"]["exact"] is True
    fast = [c["result"]["speedup"] for c in led.calls(candidate_id=best["candidate_id"], method="measure_fast")
            if c["result"].get("valid")]
    assert best["fast"] == pytest.approx(max(fast), abs=1e-4)
    assert best["full"] is not None  # confirmed on the full tier, by the agent or the harness
    assert rep["beats_reference"] == (best["fast"] > 1.0) and rep["verdict"]
    assert (out / "speedup_over_time.png").stat().st_size > 10000
    md = (out / "report.md").read_text()
    assert best["candidate_id"] in md and "Tool-call mix" in md and "Best-of-N" in md
    assert rep["tool_mix"]["categories"]["experiments"] > 0.5 and rep["ensemble"]["n"] == 2
    # the first run's engine was reattached, then stopped at the end
    assert pid is not None and not (out / "engine" / "engine.json").exists()
    print(f"\ncampaign + resume: {elapsed:.0f} s, {len(before)} -> {len(after)} experiments, "
          f"best {best['candidate_id']} {best['fast']:.3f}x fast, {best['full']}x full")


@pytest.mark.timeout(200)
def test_sigterm_writes_the_report_and_stops_the_engine(out):
    proc = subprocess.Popen(campaign(out, "120s", "--confirm", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, text=True)
    wait_for(lambda: len([c for c in submits(out) if c["finished_at"]]) >= 1, 150, "an experiment", proc)
    pid = engine_pid(out)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["interrupted"] and rep["experiments"] >= 1 and "report:" in stdout
    assert json.loads((out / "campaign.json").read_text())["spent_s"] < 120
    assert pid is not None and not (out / "engine" / "engine.json").exists()
    wait_for(lambda: not alive(pid), 30, "the engine to exit")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_summary_says_how_the_agents_ended():
    from tkcc_mcp.campaign import stop_line
    rep = {"agents": [{"status": "exhausted"}, {"status": "exhausted"}], "budget_s": 60, "spent_s": 22.0}
    assert stop_line(rep) == ("agents: 2 exhausted (tried every combination of its moves); every agent stopped "
                              "before the 60 s budget")
    rep = {"agents": [{"status": "done"}, {"status": "killed"}], "budget_s": 60, "spent_s": 60.4}
    assert stop_line(rep) == "agents: 1 done (ran to the budget or its limit); 1 killed"
    assert "before" not in stop_line({**rep, "spent_s": 10.0, "interrupted": True})


def test_campaigns_sharing_an_engine_keep_their_own_agents(tmp_path):
    """A new campaign on an engine whose agent ids another campaign used takes its --out's name as
    a prefix (it neither resumes nor counts the other's experiments); a resumed one keeps its ids."""
    from tkcc_mcp.campaign import CampaignConfig, run_campaign
    proc, info = launch.start_engine(tmp_path / "eng", "llama-3.2-1b", shrink=True, device="cpu")
    try:
        def go(name):
            return run_campaign(CampaignConfig(agent="search", budget_s=60, max_experiments=2,
                                               engines=[str(tmp_path / "eng")], out=str(tmp_path / name), confirm=0,
                                               quiet=True, print_summary=False))["report"]
        a, b = go("a"), go("b")
        assert [r["agent_id"] for r in a["agents"]] == ["search-expert-0"] and a["experiments"] == 2
        assert [r["agent_id"] for r in b["agents"]] == ["b.search-expert-0"] and b["experiments"] == 2
        again = go("a")  # resumed: its cap is reached, its ids and experiments are its own
        assert [r["agent_id"] for r in again["agents"]] == ["search-expert-0"] and again["experiments"] == 2
    finally:
        launch.stop_engine(info["pid"])
