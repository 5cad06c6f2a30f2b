"""Our own agent loop on the `anthropic` SDK, with explicit context management: the ablation
knob. The engine's tools come from the agent's MCP session (names and input schemas from
`list_tools`), every `tool_use` block is forwarded to that session, and the result goes back
as a `tool_result` (an MCP tool error, e.g. a malformed input, as `is_error`).

    summary = await run_anthropic_agent(agent_id=..., engine=EngineRef(...), workdir=..., profile=...,
                                        record=..., deadline=..., max_experiments=0, resume={}, model=...)

Context strategies (`profile.context`):
- `full`: the whole history goes to every request.
- `window`: the task plus the last `window_turns` tool exchanges (context.window).
- `fresh`: every `fresh_every` turns the history is dropped and the agent starts again from
  the task and a digest of the leaderboard (and of its notes, when it keeps them).
`source_view: summary` summarises whole-file `read_engine_source` results (ranges stay raw);
`notes: true` adds two local tools, `notes_read` and `notes_write`, on `notes.md` in the
working directory. The loop stops at the deadline, after `max_turns` model turns, at
`max_experiments` submissions, or when the model ends its turn twice with budget left.

Accounting: the usage of every response (input, output, cache tokens) and every tool call
(tool, ok, seconds) go into the agent's `AgentRecord`; API failures (status errors, lost
connections) and tool errors are recorded as errors, and an API failure ends this agent
only (`status: "error"`). The base URL comes from ANTHROPIC_BASE_URL, the key from
ANTHROPIC_API_KEY. Every request and response is a line of `transcript.jsonl`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tkcc_mcp.agents import context
from tkcc_mcp.agents.mcp_session import EngineRef, SessionClosed, ToolSession
from tkcc_mcp.agents.profiles import Profile
from tkcc_mcp.agents.record import AgentRecord, missing_credentials

RESULT_CHARS = 24000  # a tool result longer than this is cut (the agent can read a range)
NOTES_TOOLS = [
    {"name": "notes_read", "description": "Read your notes file (notes.md in your working directory).",
     "input_schema": {"type": "object", "properties": {}}},
    {"name": "notes_write", "description": "Replace (or, with append=true, extend) your notes file notes.md.",
     "input_schema": {"type": "object", "properties": {"text": {"type": "string"},
                                                       "append": {"type": "boolean"}}, "required": ["text"]}},
]


def _block(b) -> dict:
    d = b.model_dump(exclude_none=True) if hasattr(b, "model_dump") else dict(b)
    keep = {"text": ("type", "text"), "tool_use": ("type", "id", "name", "input"),
            "thinking": ("type", "thinking", "signature")}.get(d.get("type"))
    return {k: d[k] for k in keep if k in d} if keep else d


class Transcript:
    def __init__(self, path: Path):
        self.path = path

    def write(self, **kw) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), **kw}, default=str)[:200000] + "\n")


async def run_anthropic_agent(agent_id: str, engine: EngineRef, workdir: Path, profile: Profile,
                              record: AgentRecord, deadline: float, max_experiments: int = 0,
                              resume: dict | None = None, model: str = "claude-sonnet-4-5",
                              client=None) -> dict:
    import anthropic

    model = profile.model or model
    record.context, record.model = profile.strategy, model
    record.save()
    if client is None and (why := missing_credentials()):
        record.error("config", why)
        return {"status": "error", "turns": 0, "experiments": 0, "tokens": 0, "context": profile.strategy}
    if client is None:
        client = anthropic.AsyncAnthropic(base_url=os.environ.get("ANTHROPIC_BASE_URL") or None,
                                          api_key=os.environ.get("ANTHROPIC_API_KEY") or "unset",
                                          max_retries=2, timeout=600)
    workdir = Path(workdir)
    notes_path = workdir / "notes.md"
    log = Transcript(workdir / "transcript.jsonl")
    experiments = (resume or {}).get("experiments", 0)
    status = "done"
    async with ToolSession(engine, agent_id, record) as session:
        tools = list(await session.tools()) + (NOTES_TOOLS if profile.notes else [])
        task = context.task_prompt(agent_id, workdir, deadline, max_experiments, resume, notes=profile.notes)
        messages: list[dict] = [{"role": "user", "content": task}]
        since_fresh, nudges = 0, 0
        for turn in range(profile.max_turns):
            if time.monotonic() >= deadline:
                status = "budget"
                break
            if max_experiments and experiments >= max_experiments:
                status = "max-experiments"
                break
            if profile.context == "fresh" and since_fresh >= profile.fresh_every:
                board = await session.call("leaderboard", {"tier": "fast", "limit": 20})
                notes = notes_path.read_text() if profile.notes and notes_path.exists() else None
                digest = context.digest(board.data, agent_id, resume, notes)
                messages = [{"role": "user", "content": task + "\n\n(Your context was restarted.)\n" + digest}]
                since_fresh = 0
                log.write(kind="fresh", digest=digest)
            sent = context.window(messages, profile.window_turns) if profile.context == "window" else messages
            try:
                resp = await client.messages.create(model=model, max_tokens=profile.max_tokens,
                                                    system=profile.prompt, messages=sent, tools=tools)
            except anthropic.APIStatusError as e:
                record.error("api", f"HTTP {e.status_code}: {e.message}")
                log.write(kind="api_error", status=e.status_code, message=str(e.message))
                status = "error"
                break
            except anthropic.APIError as e:  # connection lost, timeout, bad response
                record.error("api", f"{type(e).__name__}: {e}")
                log.write(kind="api_error", message=str(e))
                status = "error"
                break
            record.turns += 1
            since_fresh += 1
            record.usage(resp.usage.model_dump() if resp.usage else None)
            content = [_block(b) for b in resp.content]
            log.write(kind="response", turn=record.turns, sent_messages=len(sent), stop_reason=resp.stop_reason,
                      usage=resp.usage.model_dump() if resp.usage else None, content=content)
            messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b.get("type") == "tool_use"]
            if not uses:
                left = deadline - time.monotonic()
                if nudges >= 1 or left < 10 or resp.stop_reason == "max_tokens":
                    break
                nudges += 1
                messages.append({"role": "user", "content": f"About {int(left)} s of budget left: keep improving "
                                                            "the best exact candidate."})
                continue
            results = []
            for u in uses:
                text, ok = await _run_tool(session, u, profile, notes_path, record)
                if u["name"].endswith("submit_forward_pass"):
                    experiments += 1
                if not ok:
                    record.error("tool", f"{u['name']}: {text[:500]}")
                results.append({"type": "tool_result", "tool_use_id": u["id"], "content": text[:RESULT_CHARS],
                                **({"is_error": True} if not ok else {})})
                log.write(kind="tool", name=u["name"], ok=ok, result=text[:4000])
            messages.append({"role": "user", "content": results})
        else:
            status = "max-turns"
    return {"status": status, "turns": record.turns, "experiments": experiments, "tokens": record.total_tokens,
            "context": profile.strategy}


async def _run_tool(session: ToolSession, use: dict, profile: Profile, notes_path: Path,
                    record: AgentRecord) -> tuple[str, bool]:
    name, args = use["name"], use.get("input") or {}
    if name == "notes_read":
        t0 = time.monotonic()
        text = notes_path.read_text() if notes_path.exists() else "(notes.md is empty)"
        record.tool_call(name, True, time.monotonic() - t0)
        return text, True
    if name == "notes_write":
        t0 = time.monotonic()
        if not isinstance(args.get("text"), str):
            record.tool_call(name, False, 0.0, "text must be a string")
            return "notes_write: `text` (a string) is required", False
        with open(notes_path, "a" if args.get("append") else "w") as f:
            f.write(args["text"] + ("\n" if not args["text"].endswith("\n") else ""))
        record.tool_call(name, True, time.monotonic() - t0)
        return f"notes.md: {notes_path.stat().st_size} bytes", True
    try:
        out = await session.call(name, args)
    except SessionClosed as e:
        return f"the tkcc MCP session closed: {e}", False
    text = out.text or (json.dumps(out.data) if out.data is not None else (out.error or ""))
    if (out.ok and profile.source_view == "summary" and name == "read_engine_source" and args.get("path")
            and args.get("start_line") is None and args.get("end_line") is None):
        body = context.summarise_source(context_strip(text))
        text = f"{args['path']} (summary view: ask for start_line/end_line to read raw lines)\n{body}"
    return text, out.ok


def context_strip(text: str) -> str:
    """The file text inside a read_engine_source result (numbered lines, maybe a JSON body)."""
    from tkcc_mcp.agents.moves import strip_numbers
    try:
        d = json.loads(text)
        if isinstance(d, dict) and "text" in d:
            text = d["text"]
    except ValueError:
        text = "\n".join(ln for ln in text.splitlines()[1:]) if text.split("\n", 1)[0].count(": lines ") else text
    return strip_numbers(text)
