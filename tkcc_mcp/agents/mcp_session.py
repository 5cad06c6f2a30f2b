"""An agent's MCP session with the engine: `tkcc mcp --engine URL --token-file F --agent-id ID`
spawned over stdio, through the `mcp` SDK's client. Every agent kind uses the same tools:
the offline search agent and our anthropic-SDK loop call them through `ToolSession`; Claude
Code gets the same command as its `tkcc` MCP server (`server_config`).

    async with ToolSession(engine, "search-0", record) as s:
        tools = await s.tools()                       # [{"name", "description", "input_schema"}]
        out = await s.call("submit_forward_pass", {"source": src})
        out.ok, out.data["candidate_id"], out.text

`call` never raises for what the server answers: a tool error (`is_error`, e.g. a malformed
input such as a missing `source`) comes back as `ToolOutcome(ok=False, error=...)`; only a
session that is gone (the server process died) raises `SessionClosed`. Each call is recorded
in the agent's `AgentRecord` (tool, ok, seconds, error).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tkcc_mcp.agents.record import AgentRecord


@dataclass(frozen=True)
class EngineRef:
    """Where an engine listens and the file holding its token."""
    url: str
    token_file: str


def server_command(engine: EngineRef, agent_id: str) -> tuple[str, list[str]]:
    """(command, args) that start the tkcc MCP server for one agent on stdio."""
    return sys.executable, ["-m", "tkcc_mcp.cli", "mcp", "--engine", engine.url,
                            "--token-file", str(engine.token_file), "--agent-id", agent_id]


def server_env() -> dict[str, str]:
    return {"TKCC_LOG_LEVEL": os.environ.get("TKCC_LOG_LEVEL", "WARNING"), "PYTHONUNBUFFERED": "1"}


def server_config(engine: EngineRef, agent_id: str) -> dict:
    """The `tkcc` entry of Claude Code's `mcp_servers`."""
    cmd, args = server_command(engine, agent_id)
    return {"type": "stdio", "command": cmd, "args": args, "env": server_env()}


class SessionClosed(RuntimeError):
    """The MCP server went away (its process died or the transport closed)."""


@dataclass
class ToolOutcome:
    ok: bool  # false: the tool reported an error (is_error) or the call failed
    data: dict | None = None  # the structured result (the engine's result model as JSON)
    text: str = ""  # what an LLM agent reads
    error: str | None = None
    seconds: float = 0.0
    raw: Any = field(default=None, repr=False)


class ToolSession:
    def __init__(self, engine: EngineRef, agent_id: str, record: AgentRecord | None = None,
                 errlog: Path | None = None, timeout_s: float | None = None):
        self.engine, self.agent_id, self.record = engine, agent_id, record
        self.errlog = errlog or (record.dir / "mcp.log" if record and record.workdir else None)
        self.timeout_s = timeout_s
        self._stack: AsyncExitStack | None = None
        self._client = None
        self._tools: list[dict] | None = None

    async def __aenter__(self) -> "ToolSession":
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        cmd, args = server_command(self.engine, self.agent_id)
        params = StdioServerParameters(command=cmd, args=args, env=server_env())
        self._stack = AsyncExitStack()
        errlog = (self._stack.enter_context(open(self.errlog, "a")) if self.errlog else sys.stderr)
        try:
            self._client = await self._stack.enter_async_context(
                Client(stdio_client(params, errlog=errlog), read_timeout_seconds=self.timeout_s, cache=None))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = self._client = None

    async def tools(self) -> list[dict]:
        """The server's tools as Anthropic tool definitions (name, description, input_schema)."""
        if self._tools is None:
            res = await self._client.list_tools()
            self._tools = [{"name": t.name, "description": t.description or "",
                            "input_schema": t.input_schema or {"type": "object", "properties": {}}}
                           for t in res.tools]
        return self._tools

    async def call(self, name: str, arguments: dict | None = None) -> ToolOutcome:
        t0 = time.monotonic()
        try:
            res = await self._client.call_tool(name, arguments or {})
        except Exception as e:  # noqa: BLE001 - decided below: protocol error (data) or a dead session
            out = ToolOutcome(False, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
            if self.record:
                self.record.tool_call(name, False, out.seconds, out.error)
            if _closed(e):
                raise SessionClosed(out.error) from None
            return out
        text = "\n".join(getattr(c, "text", "") for c in res.content or [] if getattr(c, "type", "") == "text")
        data = res.structured_content
        if data is None and text:
            try:
                parsed = json.loads(text)
                data = parsed if isinstance(parsed, dict) else None
            except ValueError:
                data = None
        ok = not res.is_error
        out = ToolOutcome(ok, data, text, None if ok else (text or "tool error"), time.monotonic() - t0, res)
        if self.record:
            self.record.tool_call(name, ok, out.seconds, out.error)
        return out


def _closed(e: BaseException) -> bool:
    import anyio
    return isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream,
                          BrokenPipeError, ConnectionError)) or "closed" in str(e).lower()
