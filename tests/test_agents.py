"""Model-driven agents against the scripted Anthropic API on loopback (no key, no network):
two Claude Code agents in parallel through the campaign harness, and two anthropic-SDK agents
with different context strategies (full vs a sliding window). Each reads, submits, checks and
measures through its own MCP session on a real engine; the harness records tokens, tool calls
and strategy; API failures and malformed tool inputs are recorded and stop no other agent."""
from __future__ import annotations

import json
import re
import time

import anyio
import pytest

from engine_server.ledger import Ledger
from tkcc_mcp import launch, report
from tkcc_mcp.agents.mcp_session import EngineRef
from tkcc_mcp.agents.profiles import load_profile
from tkcc_mcp.agents.record import read_calls, read_record
from tkcc_mcp.campaign import AgentSpec, CampaignConfig, State, _run_agents, run_campaign
from tkcc_mcp.scripted_api import (Conversation, Reply, ScriptedAPI, error, resolve_tool, side_reply, tool,
                                   tool_sequence)

GOOD = "from engine_server.models.llama import forward  # the reference, as a candidate\n"
ENGINE_ARGS = ["--fast-rounds", "5", "--exact-rows", "2", "--exact-steps", "2", "--call-timeout-s", "60"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    home = tmp_path_factory.mktemp("agents-engine")
    proc, info = launch.start_engine(home, "llama-3.2-1b", shrink=True, device="cpu", extra_args=ENGINE_ARGS,
                                     timeout_s=180)
    yield EngineRef(info["url"], str(info["token_file"])), home / "ledger.db"
    launch.stop_engine(info["pid"])


def agent_of(body: dict) -> str:
    """The agent id from the task prompt (the first user message)."""
    m = re.search(r"You are agent `([^`]+)`", json.dumps((body.get("messages") or [{}])[0]))
    return m.group(1) if m else ""


def cid(conv: Conversation) -> str:
    return conv.result("submit_forward_pass").json()["candidate_id"]


def experiment_steps(malformed: bool = False, fail_at: int | None = None, status: int = 500) -> list:
    steps = [("read_engine_source", {}),
             ("read_engine_source", {"path": "engine_server/models/llama.py", "start_line": 60, "end_line": 80})]
    if malformed:
        steps.append(("submit_forward_pass", {"name": "no source"}))  # missing `source`: a tool error
    steps += [("submit_forward_pass", {"source": GOOD, "name": "scripted-reference"}),
              lambda c: tool("check_bit_exact", candidate_id=cid(c)),
              lambda c: tool("measure_fast", candidate_id=cid(c)),
              ("leaderboard", {})]
    if fail_at is not None:
        steps.insert(fail_at, error(status, "api_error", "scripted failure"))
    return steps


def counted(steps: list, final: str):
    """A script that advances once per request (a windowed history cannot tell its turn)."""
    i = [0]

    def policy(body):
        k, i[0] = i[0], i[0] + 1
        step = steps[k] if k < len(steps) else final
        out = step(Conversation(body)) if callable(step) else step
        if isinstance(out, str):
            return Reply(text=out)
        if isinstance(out, tuple):
            out = tool(out[0], out[1])
        if isinstance(out, Reply):
            for c in out.tool_calls:
                c.name = resolve_tool(c.name, body)
        return out
    return policy


def per_agent(seqs: dict) -> callable:
    """One policy for every agent: the agent id in the task picks its script."""
    names = ["read_engine_source", "submit_forward_pass"]

    def policy(body):
        aid = agent_of(body)
        seq = seqs.get(aid)
        if seq is None or not any(t.get("name", "").endswith(n) for t in body.get("tools") or [] for n in names):
            return side_reply(body, "ok")
        return seq(body)
    policy.is_main = lambda body: bool(agent_of(body))
    return policy


@pytest.mark.timeout(300)
def test_two_claude_code_agents_in_parallel_through_the_campaign(engine, tmp_path, monkeypatch):
    ref, ledger_path = engine
    ids = ["claude-naive-0", "claude-naive-1"]
    seqs = {ids[0]: tool_sequence(experiment_steps(malformed=True), final="done: measured"),
            ids[1]: tool_sequence(experiment_steps(fail_at=2, status=400), final="unreachable")}
    t0 = time.monotonic()
    with ScriptedAPI(per_agent(seqs)) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "dummy")
        cfg = CampaignConfig(agent="claude", profile="naive", agents=2, budget_s=150, engines=[ref.url],
                             token_file=ref.token_file, out=str(tmp_path / "run"), confirm=0, quiet=True)
        res = run_campaign(cfg)
    elapsed = time.monotonic() - t0
    rep = res["report"]
    rows = {r["agent_id"]: r for r in rep["agents"]}
    assert set(rows) == set(ids)
    ok, failed = rows[ids[0]], rows[ids[1]]
    # the healthy agent read, submitted (one malformed call, one real), checked and measured through MCP
    calls = [c["tool"] for c in read_calls(tmp_path / "run" / "agents" / ids[0])]
    assert calls[:2] == ["read_engine_source", "read_engine_source"]
    assert calls.count("submit_forward_pass") == 2 and "check_bit_exact" in calls and "measure_fast" in calls
    assert ok["tool_errors"] == 1 and any("source" in e["message"] for e in ok["errors"] if e["kind"] == "tool")
    assert ok["status"] == "done" and ok["exact"] == 1 and ok["measured"] == 1 and ok["experiments"] == 1  # the malformed one never reached the engine
    assert ok["tokens"]["input_tokens"] > 0 and ok["tokens"]["output_tokens"] > 0 and ok["turns"] >= 7
    assert ok["context"] == "full" and ok["model"]
    # the other one hit a scripted 400 on its fourth turn: recorded, and it stopped alone
    assert failed["status"] == "error" and any(e["kind"] in ("api", "result") for e in failed["errors"])
    assert failed["experiments"] == 0 and "scripted failure" in json.dumps(failed["errors"])
    # the ledger holds what the engine saw, attributed to the agents
    led = Ledger(ledger_path)
    assert {c["agent_id"] for c in led.calls() if c["agent_id"] in ids} == set(ids)
    assert len(led.calls(agent_id=ids[0], method="check_bit_exact")) == 1
    assert rep["best"]["agent_id"] == ids[0] and rep["best"]["fast"] > 0
    assert (tmp_path / "run" / "report.md").exists() and (tmp_path / "run" / "speedup_over_time.png").exists()
    assert api.errors == []
    assert elapsed < 150


@pytest.mark.timeout(300)
def test_anthropic_sdk_agents_full_and_window_context(engine, tmp_path, monkeypatch):
    ref, ledger_path = engine
    prof = tmp_path / "tight-window.md"
    prof.write_text("---\nextends: expert\ncontext: window\nwindow_turns: 2\nmax_turns: 20\n---\nBe brief.\n")
    fresh = tmp_path / "fresh-notes.md"
    fresh.write_text("---\nextends: expert\ncontext: fresh\nfresh_every: 3\nnotes: true\nmax_turns: 20\n---\n"
                     "Keep notes.\n")
    full_id, win_id, bad_id, fresh_id = "sdk-full-0", "sdk-window-1", "sdk-broken-2", "sdk-fresh-3"
    seqs = {full_id: tool_sequence(experiment_steps(malformed=True), final="done"),
            win_id: counted(experiment_steps(), final="done"),
            bad_id: tool_sequence(experiment_steps(fail_at=1, status=500), final="unreachable"),
            fresh_id: counted([("notes_write", {"text": "tried: nothing yet"}),  # turns 1-3, then a restart
                               ("submit_forward_pass", {"source": GOOD, "name": "fresh"}),
                               lambda c: tool("check_bit_exact", candidate_id=cid(c)),
                               ("leaderboard", {}), ("notes_read", {})], final="done")}
    with ScriptedAPI(per_agent(seqs)) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "dummy")
        out = tmp_path / "run"
        cfg = CampaignConfig(agent="anthropic", agents=4, budget_s=150, out=str(out), quiet=True,
                             llm_model="claude-sonnet-5")
        specs = [AgentSpec(aid, i, "anthropic", p, ref, out / "agents" / aid, {"experiments": 0})
                 for i, (aid, p) in enumerate([(full_id, "expert"), (win_id, str(prof)), (bad_id, "naive"),
                                               (fresh_id, str(fresh))])]
        out.mkdir(parents=True)
        state = State(out)
        state.begin({"budget_s": 150}, {})
        led = Ledger(ledger_path)
        run = anyio.run(_run_agents, cfg, specs, 150.0, state, led)
        requests = api.main_requests
    assert run["signal"] is None
    res = run["results"]
    assert res[full_id]["status"] == "done" and res[win_id]["status"] == "done"
    assert res[bad_id]["status"] == "error"
    recs = {aid: read_record(out / "agents" / aid) for aid in (full_id, win_id, bad_id)}
    assert recs[full_id]["context"] == "full" and recs[win_id]["context"] == "window2"
    assert recs[full_id]["model"] == "claude-sonnet-5"
    for aid in (full_id, win_id):
        r = recs[aid]
        assert r["tokens"]["input_tokens"] > 0 and r["tokens"]["output_tokens"] > 0
        assert r["tool_calls"]["submit_forward_pass"] >= 1 and r["tool_calls"]["measure_fast"] == 1
        assert r["tool_calls"]["check_bit_exact"] == 1 and r["tool_calls"]["read_engine_source"] == 2
    # the malformed submit (no `source`) is a recorded tool error; the agent carried on
    assert recs[full_id]["tool_errors"] == 1 and recs[full_id]["tool_calls"]["submit_forward_pass"] == 2
    # the scripted 500 is recorded as an API error of that agent only
    assert [e["kind"] for e in recs[bad_id]["errors"]] == ["api"] and "500" in recs[bad_id]["errors"][0]["message"]
    # the window strategy really cut the history: its requests stay short, the full one's grow
    sizes = {aid: [len(b["messages"]) for b in requests if agent_of(b) == aid] for aid in (full_id, win_id)}
    assert max(sizes[win_id]) <= 1 + 2 * 2 < max(sizes[full_id])
    assert sizes[full_id] == sorted(sizes[full_id])
    assert api.usage["input_tokens"] >= sum(recs[a]["tokens"]["input_tokens"] for a in (full_id, win_id))
    # fresh: the context restarted from a leaderboard digest (read through MCP) and the notes
    fr = read_record(out / "agents" / fresh_id)
    assert res[fresh_id]["status"] == "done" and fr["context"] == "fresh3+notes"
    assert fr["tool_calls"]["notes_write"] == 1 and fr["tool_calls"]["notes_read"] == 1
    assert fr["tool_calls"]["leaderboard"] >= 2  # the digest's read, and the agent's own
    restarted = [b for b in requests if agent_of(b) == fresh_id and "Leaderboard digest" in json.dumps(b["messages"])]
    assert restarted and all(len(b["messages"]) <= 1 + 2 * 3 for b in restarted)
    assert "tried: nothing yet" in json.dumps(restarted[0]["messages"][0])
    assert (out / "agents" / fresh_id / "notes.md").read_text().startswith("tried: nothing yet")
    # the harness's report sees all of them
    rep = report.build(out, led, [s.as_row() for s in specs], state.d)
    assert {r["agent_id"] for r in rep["agents"]} == {full_id, win_id, bad_id, fresh_id}
    assert rep["tool_mix"]["categories"]["logging"] > 0
    assert rep["tool_mix"]["categories"]["experiments"] > 0 and rep["tokens"] > 0


def test_context_helpers():
    from tkcc_mcp.agents.context import digest, summarise_source, window
    msgs = [{"role": "user", "content": "task"}] + [
        {"role": r, "content": f"{r}{i}"} for i in range(5) for r in ("assistant", "user")]
    w = window(msgs, 2)
    assert [m["content"] for m in w[1:]] == ["assistant3", "user3", "assistant4", "user4"]
    assert "3 earlier tool exchange(s) were dropped" in w[0]["content"] and msgs[0]["content"] == "task"
    assert window(msgs[:3], 2) == msgs[:3]
    board = {"rows": [{"candidate_id": "c0002", "speedup": 1.2, "agent_id": "a", "name": "x", "exact": True},
                      {"candidate_id": "c0003", "speedup": 9.0, "agent_id": "b", "name": "y", "exact": False}]}
    d = digest(board, "a", None)
    assert "c0002 1.200x" in d and "c0003" not in d and "Your best: c0002" in d
    s = summarise_source("def f(x):\n    \"\"\"Doc.\"\"\"\n    # why\n    y = x + 1\n    return y\n")
    assert "def f(x):" in s and "Doc." in s and "# why" in s and "y = x + 1" not in s and "elided" in s


def test_profiles_load_and_inherit(tmp_path):
    from tkcc_mcp.agents.profiles import ProfileError, list_profiles
    assert {"naive", "expert", "expert-summary", "expert-notes", "expert-window", "expert-fresh"} <= set(list_profiles())
    naive, expert = load_profile("naive"), load_profile("expert")
    assert "as fast as possible" in naive.prompt and "bitwise" in naive.prompt
    for word in ("CUDA graph", "prepare", "GQA", "Triton", "MoE", "bit"):
        assert word in expert.prompt, word
    w, f = load_profile("expert-window"), load_profile("expert-fresh")
    assert w.context == "window" and w.window_turns > 0 and w.prompt.startswith(expert.prompt)
    assert f.context == "fresh" and f.fresh_every > 0
    assert load_profile("expert-summary").source_view == "summary" and load_profile("expert-notes").notes
    bad = tmp_path / "bad.md"
    bad.write_text("---\ncontext: sideways\n---\nx\n")
    with pytest.raises(ProfileError, match="context"):
        load_profile(str(bad))
    bad.write_text("---\nwindow: 3\n---\nx\n")
    with pytest.raises(ProfileError, match="unknown header"):
        load_profile(str(bad))
