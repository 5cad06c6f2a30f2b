"""The continual loop: serve one trace, switch to another, detect the drift, recompile with a
short campaign, promote under load with no failed request, and roll back a planted regression."""
import json
import threading
import time

import pytest

from engine_server import drift as D
from engine_server import traffic
from engine_server.engine import EngineConfig
from engine_server.serving import ServeConfig, Service, ServingServer, StepRecord
from tkcc_mcp import replay
from tkcc_mcp.continual import Continual, ContinualConfig, compare_steps, judge

# exact (it calls the reference) and slow: what the canary must catch
SLOW = ("import time\nfrom engine_server.models import llama as ref\n\ndef forward(state, batch):\n"
        "    time.sleep(0.02)\n    return ref.forward(state, batch)\n")


def steps(rows_ms: list[tuple[int, float]], cid: str = "x") -> list[StepRecord]:
    return [StepRecord(float(i), r, ms / 1e3, cid) for i, (r, ms) in enumerate(rows_ms)]


def test_judge():
    exact = {"ok": True, "exact": True}
    full = {"ok": True, "valid": True, "speedup": 1.3, "speedup_ci95": [1.2, 1.4]}
    assert judge(exact, full, 1.0, 0.0)[0]
    ok, why = judge(exact, full, 1.25, 0.0)  # the serving pass is already 1.25x: 1.2 / 1.25 < 1
    assert not ok and "does not beat the serving pass" in why
    assert not judge({"ok": True, "exact": False, "first_mismatch": {"step": 0}}, full, 1.0, 0.0)[0]
    assert not judge(exact, full | {"valid": False, "violations": ["x"]}, 1.0, 0.0)[0]
    assert judge(exact, full | {"speedup_ci95": [0.9, 1.1]}, 1.0, -0.2)[0]  # a negative bar accepts a tie


def test_compare_steps():
    old = steps([(1, 1.0)] * 10 + [(4, 2.0)] * 10)
    assert compare_steps(old, steps([(1, 1.0)] * 10 + [(4, 2.0)] * 10), 0.15, 10)["verdict"] == "pass"
    slow = compare_steps(old, steps([(1, 3.0)] * 10 + [(4, 6.0)] * 10), 0.15, 10)
    assert slow["verdict"] == "regressed" and slow["ratio"] == pytest.approx(3.0)
    # a batch-mix change alone is no regression: 2 rows between the sizes seen, 8 rows above them
    mix = compare_steps(old, steps([(2, 1.3)] * 10 + [(8, 3.5)] * 10), 0.15, 10)
    assert mix["verdict"] == "pass", mix
    assert compare_steps(old, steps([(1, 9.0)] * 3), 0.15, 10)["verdict"] == "inconclusive"


def scaled(src, out, stride: int, n: int = 48, span_s: float = 3.0):
    """`n` requests spread over a real trace, lengths cut for the CPU (same factors for every
    trace, so their difference stays), arriving evenly over `span_s`; as a serving log."""
    reqs = traffic.read_trace(src).requests[::stride][:n]
    with open(out, "w") as f:
        for i, r in enumerate(reqs):
            f.write(json.dumps({"arrival_s": i * span_s / n, "prompt_len": max(1, min(400, r.prompt_len // 16)),
                                "output_len": max(1, min(24, r.output_len // 2))}) + "\n")
    return out


def wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_drift_recompile_promote_and_roll_back(tmp_path):
    A = scaled(traffic.DATA_DIR / "traces" / "azure_llm_2023_code.csv", tmp_path / "azure.jsonl", 150)
    B = scaled(traffic.DATA_DIR / "traces" / "mooncake_fast25_synthetic_trace.jsonl", tmp_path / "mooncake.jsonl", 70)
    assert D.drift(D.profile_file(A), D.profile_file(B)).drifted  # the premise
    svc = Service(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu", traffic=str(A)),
                  ServeConfig(home=str(tmp_path / "home"), port=0))
    cont = Continual(svc, ContinualConfig(
        window_requests=32, check_every_s=0.5, cooldown_s=600, campaign_budget_s=60, campaign_max_experiments=3,
        campaign_engine_args="--fast-rounds 5 --full-requests 6 --full-reps 2",
        # CPU timings of a shrunk model under test load are noisy: accept any exact winner that is not
        # far slower (judge() is tested above with the default bar), keep the canary's bar wide too
        min_full_gain=-0.5, canary_min_steps=20, canary_max_s=60, canary_tolerance=0.3),
        D.DriftConfig(min_requests=24))
    svc.continual = cont
    srv = ServingServer(svc).start()
    cont.start()
    reports, stop = [], threading.Event()
    try:
        reports.append(replay.replay(srv.url, traffic.read_trace(A)))
        d, _, _ = cont.check()
        assert d is not None and not d.drifted, d.summary()  # serving what it was tuned on: no drift
        assert "drift_detected" not in [x["kind"] for x in cont.decisions]

        def load():  # the new traffic, over and over, until the test ends
            while not stop.is_set():
                reports.append(replay.replay(srv.url, traffic.read_trace(B), stop=stop))
        loader = threading.Thread(target=load)
        loader.start()
        kinds = lambda: [x["kind"] for x in cont.decisions]  # noqa: E731
        wait_for(lambda: "retuned" in kinds() or "continual_error" in kinds(), 240, "a recompilation")
        assert "continual_error" not in kinds(), cont.decisions
        seq = [k for k in kinds() if k in ("drift_detected", "campaign_started", "campaign_finished", "promoted",
                                           "canary", "retuned")]
        assert seq == ["drift_detected", "campaign_started", "campaign_finished", "promoted", "canary", "retuned"], \
            cont.decisions
        ev = {x["kind"]: x for x in cont.decisions}
        assert ev["drift_detected"]["distances"]["drifted"]
        assert ev["campaign_finished"]["experiments"] >= 1 and ev["campaign_finished"]["best"]["exact"]
        winner = ev["promoted"]["candidate_id"]
        assert ev["promoted"]["exact"]["exact"] is True and ev["promoted"]["full"]["valid"] is True
        assert ev["canary"]["verdict"] in ("pass", "regressed", "inconclusive")
        served_by_winner = [r for r in svc.log.window(400) if winner in r["forward_passes"]]
        assert served_by_winner  # requests were served by the promoted pass
        current = svc.active  # the winner, unless its canary rolled it back

        planted = cont.promote_with_canary(SLOW, name="planted-slow")
        assert planted["ok"] and planted["canary"]["verdict"] == "regressed", planted
        assert planted["rolled_back"] and svc.active == current
    finally:
        stop.set()
        if "loader" in locals():
            loader.join(timeout=120)
        srv.stop()
    assert reports and all(r["failed"] == 0 for r in reports), [r["errors"] for r in reports if r["failed"]]
    assert sum(r["ok"] for r in reports) >= 96
    assert svc.metrics.failures == 0
    events = svc.ledger.events()
    by_kind = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e)
    for kind in ("continual_start", "drift_detected", "campaign_started", "campaign_finished", "promoted", "canary",
                 "rolled_back", "retuned"):
        assert kind in by_kind, kind
    assert by_kind["drift_detected"][0]["data"]["distances"]["prompt"]["ks"] > 0
    slow_id = planted["candidate_id"]
    assert any(e["candidate_id"] == slow_id and e["data"]["verdict"] == "regressed" for e in by_kind["canary"])
    assert any(e["candidate_id"] == slow_id and "canary" in e["data"]["reason"] for e in by_kind["rolled_back"])
    assert svc.ledger.candidate(winner)["ok"] and svc.ledger.candidate(winner)["agent_id"] == "continual"
