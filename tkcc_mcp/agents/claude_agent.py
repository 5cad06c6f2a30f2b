"""Claude Code (through the Claude Agent SDK) as a campaign agent, with the tkcc MCP server
attached: `tkcc mcp --engine URL --agent-id ID` on stdio, the same tools every agent uses.

    summary = await run_claude_agent(agent_id=..., engine=EngineRef(...), workdir=..., profile=...,
                                     record=..., deadline=..., max_experiments=0, resume={}, model=...)

Options that work headless and as root (see tkcc_mcp/scripted_api.py): no built-in tools
except Read/Write/Edit when the profile keeps notes, `allowed_tools=["mcp__tkcc", ...]`
(no permission bypass), `strict_mcp_config`, no setting sources, `cwd` = the agent's working
directory and its own CLAUDE_CONFIG_DIR in it. ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY pass
through from the environment.

Recorded from the message stream: each tool use (tool, ok from its tool_result, seconds),
each session's usage and cost from its ResultMessage, errors (a failed API call, a result
with is_error, the CLI exiting). Context: `full` runs one session of `max_turns`; `fresh`
runs successive sessions of `fresh_every` turns, each seeded with a leaderboard digest read
through the MCP tools; `window` is not a knob Claude Code exposes (it compacts on its own),
so it runs as `full` and the record says so. `source_view: summary` puts summaries of the
reference files in the first prompt (Claude Code reads tool results raw).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio

from tkcc_mcp.agents import context
from tkcc_mcp.agents.mcp_session import EngineRef, ToolSession, server_config
from tkcc_mcp.agents.profiles import Profile
from tkcc_mcp.agents.record import AgentRecord, missing_credentials, short_tool

NOTES_TOOLS = ["Read", "Write", "Edit"]


def claude_env(workdir: Path) -> dict[str, str]:
    env = {"CLAUDE_CONFIG_DIR": str(workdir / ".claude"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "ENABLE_TOOL_SEARCH": "false"}
    for k in ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


def options(agent_id: str, engine: EngineRef, workdir: Path, profile: Profile, model: str, max_turns: int, logf):
    """The session's options; the CLI's stderr goes to `logf` (claude.log in the working directory)."""
    from claude_agent_sdk import ClaudeAgentOptions

    tools = NOTES_TOOLS if profile.notes else []
    return ClaudeAgentOptions(
        mcp_servers={"tkcc": server_config(engine, agent_id)}, strict_mcp_config=True, setting_sources=[],
        tools=tools, allowed_tools=["mcp__tkcc"] + tools, cwd=str(workdir), max_turns=max_turns,
        system_prompt=profile.prompt, model=model, env=claude_env(workdir),
        stderr=lambda line: (logf.write(line + "\n"), logf.flush()))


async def run_claude_agent(agent_id: str, engine: EngineRef, workdir: Path, profile: Profile,
                           record: AgentRecord, deadline: float, max_experiments: int = 0,
                           resume: dict | None = None, model: str = "claude-sonnet-4-5") -> dict:
    from claude_agent_sdk import AssistantMessage, ResultMessage, ToolResultBlock, ToolUseBlock, UserMessage, query

    model = profile.model or model
    workdir = Path(workdir)
    strategy = profile.strategy
    if profile.context == "window":
        record.notes.append("context 'window' is not a Claude Code knob: ran as 'full' (it compacts on its own)")
        strategy = strategy.replace(f"window{profile.window_turns}", "full")
    record.context, record.model = strategy, model
    record.save()
    if why := missing_credentials():
        record.error("config", why)
        return {"status": "error", "turns": 0, "experiments": 0, "tokens": 0, "context": strategy}
    experiments = (resume or {}).get("experiments", 0)
    extra = _summaries() if profile.source_view == "summary" else ""
    task = context.task_prompt(agent_id, workdir, deadline, max_experiments, resume, notes=profile.notes,
                               extra=extra)
    status, turns_left, session_no = "done", profile.max_turns, 0
    while turns_left > 0 and time.monotonic() < deadline:
        if max_experiments and experiments >= max_experiments:
            status = "max-experiments"
            break
        per = min(turns_left, profile.fresh_every) if profile.context == "fresh" else turns_left
        prompt = task
        if profile.context == "fresh" and session_no > 0:
            prompt = task + "\n\n(Your context was restarted.)\n" + await _digest(engine, agent_id, resume,
                                                                                   workdir, profile, record)
        session_no += 1
        started: dict[str, tuple[str, float]] = {}
        result = None
        stopped = False
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope, \
                open(workdir / "claude.log", "a") as logf:
            try:
                opts = options(agent_id, engine, workdir, profile, model, per, logf)
                async for m in query(prompt=prompt, options=opts):
                    if isinstance(m, AssistantMessage):
                        if m.error:
                            record.error("api", f"assistant message error: {m.error}")
                        for b in m.content:
                            if isinstance(b, ToolUseBlock):
                                started[b.id] = (b.name, time.monotonic())
                                if short_tool(b.name) == "submit_forward_pass":
                                    experiments += 1
                    elif isinstance(m, UserMessage) and isinstance(m.content, list):
                        for b in m.content:
                            if isinstance(b, ToolResultBlock) and b.tool_use_id in started:
                                name, t0 = started.pop(b.tool_use_id)
                                err = _text(b.content) if b.is_error else None
                                record.tool_call(name, not b.is_error, time.monotonic() - t0, err)
                                if b.is_error:
                                    record.error("tool", f"{short_tool(name)}: {err[:500]}")
                        if max_experiments and experiments >= max_experiments:
                            stopped = True
                            break
                    elif isinstance(m, ResultMessage):
                        result = m
            except Exception as e:  # noqa: BLE001 - the CLI failed (API error, exit): this agent only
                record.error("api", f"{type(e).__name__}: {str(e)[:1500]}")
                status = "error"
        if result is not None:
            record.usage(result.usage, result.total_cost_usd)
            record.turns += result.num_turns or 0
            turns_left -= result.num_turns or per
            if result.is_error:
                record.error("result", f"{result.subtype}: {result.errors or result.result} "
                                       f"(HTTP {result.api_error_status})")
                status = "error"
        else:
            turns_left -= per
        if scope.cancelled_caught:
            status = "budget"
            break
        if status == "error" or stopped:
            status = "max-experiments" if stopped else status
            break
        if profile.context != "fresh":
            break  # one session: the model ended its turn
    return {"status": status, "turns": record.turns, "experiments": experiments, "tokens": record.total_tokens,
            "context": strategy, "sessions": session_no}


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(c.get("text", "") for c in content or [] if isinstance(c, dict))


async def _digest(engine: EngineRef, agent_id: str, resume: dict | None, workdir: Path, profile: Profile,
                  record: AgentRecord) -> str:
    """The leaderboard through the agent's own MCP tools (recorded as its tool call)."""
    async with ToolSession(engine, agent_id, record) as s:
        board = await s.call("leaderboard", {"tier": "fast", "limit": 20})
    notes = (workdir / "notes.md").read_text() if profile.notes and (workdir / "notes.md").exists() else None
    return context.digest(board.data, agent_id, resume, notes)


def _summaries() -> str:
    from tkcc_mcp.agents.moves import SNAPSHOT
    parts = ["Summaries of the reference files (read ranges with read_engine_source for the code):"]
    for rel in ("engine_server/models/llama.py", "engine_server/models/common.py"):
        p = SNAPSHOT / rel
        if p.exists():
            parts += [f"## {rel}", context.summarise_source(p.read_text())]
    return "\n".join(parts)
