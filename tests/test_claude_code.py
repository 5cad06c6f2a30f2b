"""The real Claude Code CLI (bundled with claude-agent-sdk) attached to `tkcc mcp` over stdio,
driving a real engine. The model is `ScriptedAPI` (a scripted Messages API on loopback): it
reads the source, submits the reference it read back, measures and checks it, then answers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from engine_server.ledger import Ledger
from tkcc_mcp import launch
from tkcc_mcp.scripted_api import Conversation, ScriptedAPI, tool, tool_sequence

ROOT = Path(__file__).resolve().parent.parent
SNAP_REF = (ROOT / "source_snapshots/engine_server/models/llama.py").read_text()
TOOLS = ["read_engine_source", "submit_forward_pass", "measure_fast", "check_bit_exact"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    home = tmp_path_factory.mktemp("claude-engine")
    proc, info = launch.start_engine(home, "llama-3.2-1b", shrink=True, device="cpu", timeout_s=180,
                                     env={"OMP_NUM_THREADS": "1"}, extra_args=["--call-timeout-s", "60"])
    yield home, info
    launch.stop_engine(proc.pid)


def read_back(numbered: str) -> str:
    """The module text from read_engine_source's numbered lines ('<5-wide number>  <line>')."""
    return "\n".join(line[7:] for line in numbered.splitlines()) + "\n"


def script():
    def read_reference(conv: Conversation):
        return tool("read_engine_source", path=conv.result("read_engine_source").json()["reference_forward"])

    def submit(conv: Conversation):
        text = conv.result("read_engine_source").json()["text"]
        return tool("submit_forward_pass", {"source": read_back(text), "name": "claude-ref"})

    def cid(conv: Conversation) -> str:
        return conv.result("submit_forward_pass").json()["candidate_id"]

    def final(conv: Conversation) -> str:
        m, x = conv.result("measure_fast").json(), conv.result("check_bit_exact").json()
        return f"{m['candidate_id']}: speedup {m['speedup']:.3f}, exact {x['exact']}"

    return tool_sequence(["read_engine_source", read_reference, submit,
                          lambda c: tool("measure_fast", candidate_id=cid(c)),
                          lambda c: tool("check_bit_exact", candidate_id=cid(c))],
                         final=final, tool_names=TOOLS)


@pytest.mark.timeout(300)
def test_claude_code_reads_submits_and_measures_through_tkcc_mcp(engine, tmp_path):
    from claude_agent_sdk import AssistantMessage, ClaudeAgentOptions, ResultMessage, ToolUseBlock, query

    home, info = engine
    stderr: list[str] = []
    (tmp_path / "work").mkdir()

    async def run(api: ScriptedAPI) -> list:
        opts = ClaudeAgentOptions(
            mcp_servers={"tkcc": {"type": "stdio", "command": sys.executable,
                                  "args": ["-m", "tkcc_mcp.cli", "mcp", "--engine", info["url"],
                                           "--token-file", info["token_file"], "--agent-id", "claude-1"],
                                  "env": {"TKCC_LOG_LEVEL": "WARNING"}}},
            strict_mcp_config=True, setting_sources=[], tools=[], allowed_tools=["mcp__tkcc"],
            cwd=str(tmp_path / "work"), max_turns=10, stderr=stderr.append,
            env=api.claude_env(CLAUDE_CONFIG_DIR=str(tmp_path / "claude-config")))
        out = []
        with anyio.fail_after(240):
            async for m in query(prompt="Make the engine's forward pass faster.", options=opts):
                out.append(m)
        return out

    with ScriptedAPI(script()) as api:
        msgs = anyio.run(run, api)

    result = msgs[-1]
    assert isinstance(result, ResultMessage) and not result.is_error, (result, stderr[-20:])
    uses = [b.name for m in msgs if isinstance(m, AssistantMessage) for b in m.content if isinstance(b, ToolUseBlock)]
    assert uses == ["mcp__tkcc__" + t for t in ["read_engine_source", *TOOLS]]
    assert api.errors == [] and api.unknown == []

    # each tool's result reached the API in the next request, as the engine's output
    convs = [Conversation(b) for b in api.main_requests]
    assert len(convs) == 6
    listing = convs[1].last
    assert listing.short == "read_engine_source"
    assert listing.json()["reference_forward"] == "engine_server/models/llama.py"
    assert read_back(convs[2].last.json()["text"]) == SNAP_REF
    sub = convs[3].last.json()
    assert convs[3].last.short == "submit_forward_pass" and sub["ok"] and sub["stage"] == "ready"
    fast = convs[4].last.json()
    assert fast["candidate_id"] == sub["candidate_id"] and fast["ok"] and fast["speedup"] > 0
    assert len(fast["speedup_ci95"]) == 2 and fast["tier"] == "fast"
    exact = convs[5].last.json()
    assert exact["candidate_id"] == sub["candidate_id"] and exact["exact"] is True
    assert not any(c.is_error for c in convs[5].results)
    assert result.result == f"{sub['candidate_id']}: speedup {fast['speedup']:.3f}, exact True"

    # and the ledger knows who asked
    led = Ledger(Path(home) / "ledger.db")
    cand = led.candidate(sub["candidate_id"])
    assert cand["agent_id"] == "claude-1" and cand["name"] == "claude-ref" and cand["source"] == SNAP_REF
    assert [c["method"] for c in led.calls(agent_id="claude-1")] == ["read_engine_source", *TOOLS]
    measured = led.calls(candidate_id=sub["candidate_id"], method="measure_fast")[0]
    assert measured["result"]["speedup"] == fast["speedup"]  # the agent saw what the ledger holds
