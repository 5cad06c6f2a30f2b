"""Scripted Anthropic Messages API on 127.0.0.1, for tests and offline runs.

Drives the real Claude Code CLI (as bundled with claude-agent-sdk) and the
``anthropic`` SDK deterministically: no network, no real API key.

Contract
--------
``with ScriptedAPI(policy) as api:`` serves on ``api.url`` (free port).
Point Claude Code at it with ``env=api.claude_env()`` (ANTHROPIC_BASE_URL,
ANTHROPIC_API_KEY=dummy, no telemetry/autoupdate/non-essential traffic,
ENABLE_TOOL_SEARCH=false), or ``anthropic.Anthropic(base_url=api.url,
api_key="dummy")``.

Endpoints: ``POST /v1/messages`` (SSE when ``stream`` is true: message_start,
ping, content_block_start/delta(text_delta|input_json_delta)/stop,
message_delta(stop_reason, usage), message_stop; else one JSON message),
``POST /v1/messages/count_tokens`` (chars/4), ``GET /v1/models[/id]``,
``HEAD|GET /api/hello`` (Claude Code's connectivity probe). Anything else:
404 Anthropic-style error, recorded in ``api.unknown``.

``policy(body: dict) -> Reply | APIError | str`` is called for every
``/v1/messages`` request, serialized, in the server thread. A ``str`` is a
text reply. ``Reply(text=..., tool_calls=[ToolCall(name, input)])``;
helpers ``text()``, ``tool()``, ``tools()``, ``error()``. Tool names resolve
by suffix against the request's tools (``submit_forward_pass`` ->
``mcp__tkcc__submit_forward_pass``). ``APIError`` answers with its HTTP status
and ``{"type": "error", "error": {...}}``; ``x-should-retry: false`` unless
``retryable``. Claude Code honours the header (retryable 429/5xx/529: retried
with ~0.5 s, 1 s, ... backoff; otherwise it fails at once), but re-sends a 400
up to 3 times at once with betas dropped (its feature fallback). A policy
exception answers 400 and is kept in ``api.errors``.

``tool_sequence(steps, final=...)`` builds a stateless policy: the step index
is the number of assistant turns already in the main conversation, so
retries and parallel sessions are safe. A step is a tool name, a
``(name, input)`` pair, a ``ToolCall``/``Reply``/``APIError``, or a callable
``(Conversation) -> any of those | str``; ``Conversation`` exposes earlier
calls and their tool_result contents (``conv.result("submit_forward_pass")
.json()["candidate_id"]``). After the steps it answers ``final`` (str or
callable). Requests that are not the main conversation (no tool of the
script in ``tools`` nor deferred behind ToolSearch: title/summary generation,
``max_tokens=1`` quota probes, ...) get ``side_text``, as JSON when
``output_config.format`` asks for a json_schema (Claude Code's session title:
``{"title": side_text}``). If a tool is deferred (ToolSearch on), the
sequence first calls ``ToolSearch`` with ``select:<full name>`` on its own.
``fail_first(policy, n, error)`` fails the first n main requests (default
529 overloaded: a transient API failure).

Claude Code (claude-agent-sdk ``ClaudeAgentOptions``) that works here:
``mcp_servers={"tkcc": {"type": "stdio", "command": sys.executable, "args":
[...]}}, allowed_tools=["mcp__tkcc"], env=api.claude_env(CLAUDE_CONFIG_DIR=
tmp), cwd=tmp, strict_mcp_config=True, setting_sources=[], tools=[]`` (no
built-in tools), ``max_turns=...``. ``permission_mode="bypassPermissions"``
is refused when running as root (unless IS_SANDBOX=1).

Recorded (thread-safe copies): ``api.requests`` (every /v1/messages body),
``api.main_requests``, ``api.log`` (``Recorded`` for every HTTP request, with
usage), ``api.usage`` (summed rough token counts: chars/4 in, chars/4 out).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = [
    "APIError", "Conversation", "Recorded", "Reply", "ScriptedAPI", "ToolCall",
    "ToolResult", "ToolSequence", "error", "fail_first", "is_main_request",
    "resolve_tool", "rough_tokens", "side_reply", "text", "tool", "tool_sequence", "tools",
]

TOOL_SEARCH = "ToolSearch"
_STEP_ID = "toolu_s"  # ids of scripted tool_use blocks
_SEARCH_ID = "toolu_ts"  # ids of automatic ToolSearch calls


# --------------------------------------------------------------------------- replies
@dataclass
class ToolCall:
    name: str
    input: dict = field(default_factory=dict)
    id: str | None = None


@dataclass
class Reply:
    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    stop_reason: str | None = None  # default: "tool_use" if tool_calls else "end_turn"
    delay: float = 0.0  # seconds before answering


@dataclass
class APIError:
    status: int = 500
    type: str = "api_error"
    message: str = "scripted API error"
    retryable: bool = False

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message},
                "request_id": "req_scripted"}


Outcome = Union[Reply, APIError, str]
Policy = Callable[[dict], Outcome]


def text(s: str) -> Reply:
    return Reply(text=s)


def tool(name: str, _input: dict | None = None, **kw: Any) -> Reply:
    return Reply(tool_calls=[ToolCall(name, {**(_input or {}), **kw})])


def tools(*calls: ToolCall | tuple, text: str | None = None) -> Reply:
    return Reply(text=text, tool_calls=[_as_call(c) for c in calls])


def error(status: int = 500, type: str = "api_error", message: str = "scripted API error",
          retryable: bool = False) -> APIError:
    return APIError(status, type, message, retryable)


def _as_call(c: Any) -> ToolCall:
    if isinstance(c, ToolCall):
        return c
    if isinstance(c, str):
        return ToolCall(c)
    if isinstance(c, tuple):
        return ToolCall(c[0], dict(c[1]) if len(c) > 1 else {})
    if isinstance(c, dict):
        return ToolCall(c["name"], dict(c.get("input", {})))
    raise TypeError(f"not a tool call: {c!r}")


def rough_tokens(obj: Any) -> int:
    s = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return max(1, (len(s) + 3) // 4)


# --------------------------------------------------------------------------- request views
def _tool_names(body: dict) -> list[str]:
    return [t.get("name", "") for t in body.get("tools") or [] if isinstance(t, dict)]


def _matches(full: str, short: str) -> bool:
    return full == short or full.endswith("__" + short)


def _deferred(body: dict, short: str) -> str | None:
    """Full name of a tool announced only by name (deferred behind ToolSearch)."""
    if TOOL_SEARCH not in _tool_names(body):
        return None
    pat = re.compile(r"(?<![\w.-])(mcp__[\w.-]+?__" + re.escape(short) + r")(?![\w.-])")
    for s in _strings([body.get("system"), body.get("messages")]):
        m = pat.search(s)
        if m:
            return m.group(1)
    return None


def _strings(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def resolve_tool(short: str, body: dict) -> str:
    """Full tool name in this request for ``short``: exact, else ``*__short``."""
    names = _tool_names(body)
    if short in names:
        return short
    hits = [n for n in names if _matches(n, short)]
    if hits:
        return sorted(hits, key=lambda n: (not n.startswith("mcp__"), n))[0]
    return _deferred(body, short) or short


def is_main_request(body: dict, names: Iterable[str] = ()) -> bool:
    """True for the agent conversation: its tools include one of ``names``
    (by suffix, or deferred behind ToolSearch). Without names: has tools."""
    names = list(names)
    present = _tool_names(body)
    if not names:
        return bool(present)
    return any(_matches(p, n) for p in present for n in names) or any(
        _deferred(body, n) for n in names)


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for b in content or []:
        if isinstance(b, dict) and b.get("type") == "text":
            out.append(b.get("text", ""))
        elif isinstance(b, dict) and b.get("type") != "image":
            out.append(json.dumps(b))
    return "\n".join(out)


@dataclass
class ToolResult:
    id: str
    name: str  # full name as sent, e.g. mcp__tkcc__submit_forward_pass
    input: dict
    content: str | None = None  # None while no tool_result came back
    is_error: bool = False

    @property
    def short(self) -> str:
        return self.name.rsplit("__", 1)[-1]

    def json(self) -> Any:
        """Content parsed as JSON (the first JSON object/array in it)."""
        s = self.content or ""
        try:
            return json.loads(s)
        except ValueError:
            m = re.search(r"[\[{].*[\]}]", s, re.S)
            return json.loads(m.group(0)) if m else None


class Conversation:
    """Read-only view of one /v1/messages request body."""

    def __init__(self, body: dict):
        self.body = body
        self.messages: list[dict] = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        calls: dict[str, ToolResult] = {}
        for m in self.messages:
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for b in content:
                if not isinstance(b, dict):
                    continue
                if m.get("role") == "assistant" and b.get("type") == "tool_use":
                    calls[b.get("id", "")] = ToolResult(b.get("id", ""), b.get("name", ""),
                                                        b.get("input") or {})
                elif b.get("type") == "tool_result" and b.get("tool_use_id") in calls:
                    r = calls[b["tool_use_id"]]
                    r.content, r.is_error = _block_text(b.get("content")), bool(b.get("is_error"))
        self.calls: list[ToolResult] = [c for c in calls.values() if not c.id.startswith(_SEARCH_ID)]

    @property
    def tool_names(self) -> list[str]:
        return _tool_names(self.body)

    @property
    def results(self) -> list[ToolResult]:
        return [c for c in self.calls if c.content is not None]

    @property
    def last(self) -> ToolResult | None:
        return self.results[-1] if self.results else None

    def result(self, short: str) -> ToolResult | None:
        """Latest call of tool ``short`` (suffix match) that has a result."""
        hits = [c for c in self.results if _matches(c.name, short)]
        return hits[-1] if hits else None

    @property
    def turns(self) -> int:
        """Assistant turns so far (consecutive assistant messages count once;
        turns made only of automatic ToolSearch calls do not count)."""
        n, prev = 0, None
        for m in self.messages:
            role = m.get("role")
            if role == "assistant" and prev != "assistant" and not _only_search(m):
                n += 1
            if role in ("assistant", "user"):
                prev = role
        return n

    @property
    def prompt(self) -> str:
        """Text of the last user message that carries no tool_result."""
        for m in reversed(self.messages):
            c = m.get("content")
            if m.get("role") == "user" and (isinstance(c, str) or not any(
                    isinstance(b, dict) and b.get("type") == "tool_result" for b in c or [])):
                return _block_text(c)
        return ""


def _only_search(m: dict) -> bool:
    c = m.get("content")
    uses = [b for b in c if isinstance(b, dict) and b.get("type") == "tool_use"] if isinstance(c, list) else []
    return bool(uses) and all(str(b.get("id", "")).startswith(_SEARCH_ID) for b in uses)


# --------------------------------------------------------------------------- policies
Step = Union[str, tuple, ToolCall, Reply, APIError, Callable[[Conversation], Any]]


class ToolSequence:
    """Policy: answer the main conversation's n-th turn with ``steps[n]``."""

    def __init__(self, steps: Sequence[Step], final: str | Callable[[Conversation], Any] = "Done.",
                 side_text: str = "OK", tool_names: Iterable[str] | None = None):
        self.steps, self.final, self.side_text = list(steps), final, side_text
        if tool_names is None:
            tool_names = [_as_call(s).name for s in self.steps
                          if isinstance(s, (str, tuple, ToolCall))]
            tool_names += [c.name for s in self.steps if isinstance(s, Reply) for c in s.tool_calls]
        self.tool_names = sorted(set(tool_names))

    def is_main(self, body: dict) -> bool:
        return is_main_request(body, self.tool_names)

    def __call__(self, body: dict) -> Outcome:
        if not self.is_main(body):
            return side_reply(body, self.side_text)
        conv = Conversation(body)
        n = conv.turns
        step = self.steps[n] if n < len(self.steps) else self.final
        if callable(step):  # a callable's str is text; a static str is a tool name
            out = step(conv)
            if isinstance(out, str):
                return Reply(text=out)
        else:
            out = step if n < len(self.steps) else Reply(text=step)
        if isinstance(out, APIError):
            return out
        reply = out if isinstance(out, Reply) else Reply(tool_calls=[_as_call(out)])
        calls = [ToolCall(resolve_tool(c.name, body), c.input, c.id or f"{_STEP_ID}{n:03d}_{k}_{uuid.uuid4().hex[:12]}")
                 for k, c in enumerate(reply.tool_calls)]
        present, searched = set(conv.tool_names), set()
        for m in conv.messages:  # names already asked of ToolSearch: never loop on them
            if m.get("role") == "assistant" and _only_search(m):
                for b in m["content"]:
                    q = str((b.get("input") or {}).get("query", ""))
                    searched.update(q.removeprefix("select:").split(","))
        missing = sorted({c.name for c in calls if c.name not in present | searched})
        if missing and TOOL_SEARCH in present:  # deferred tools: load them first
            return Reply(tool_calls=[ToolCall(TOOL_SEARCH, {"query": "select:" + ",".join(missing),
                                                            "max_results": len(missing)},
                                              f"{_SEARCH_ID}_{uuid.uuid4().hex[:12]}")])
        return Reply(reply.text, calls, reply.stop_reason, reply.delay)


def _schema_example(schema: Any, text_: str) -> Any:
    if not isinstance(schema, dict):
        return text_
    if "const" in schema or "enum" in schema:
        return schema.get("const", (schema.get("enum") or [None])[0])
    t = schema.get("type")
    t = t[0] if isinstance(t, list) else t
    if t == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _schema_example(props.get(k), text_) for k in schema.get("required") or props}
    return {"array": [], "integer": 0, "number": 0, "boolean": False, "null": None}.get(t, text_)


def side_reply(body: dict, text_: str = "OK") -> Reply:
    """Short answer to a side request; JSON matching ``output_config.format``
    when one is asked for (Claude Code's session-title request does)."""
    fmt = (body.get("output_config") or {}).get("format") or body.get("output_format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return Reply(text=json.dumps(_schema_example(fmt.get("schema"), text_)))
    return Reply(text=text_)


def tool_sequence(steps: Sequence[Step], final: str | Callable[[Conversation], Any] = "Done.",
                  side_text: str = "OK", tool_names: Iterable[str] | None = None) -> ToolSequence:
    """See module docstring. ``tool_names``: short names that mark the main
    conversation (default: names of the non-callable steps; if none, any
    request with tools is main)."""
    return ToolSequence(steps, final, side_text, tool_names)


def fail_first(policy: Policy, n: int = 1, err: APIError | None = None) -> Policy:
    """Answer the first ``n`` main requests with ``err``, then defer to ``policy``."""
    err = err or APIError(529, "overloaded_error", "Overloaded", retryable=True)
    lock, left = threading.Lock(), [n]
    is_main = getattr(policy, "is_main", None)

    def wrapped(body: dict) -> Outcome:
        if is_main is None or is_main(body):
            with lock:
                if left[0] > 0:
                    left[0] -= 1
                    return err
        return policy(body)

    if is_main is not None:
        wrapped.is_main = is_main  # type: ignore[attr-defined]
    return wrapped


# --------------------------------------------------------------------------- server
@dataclass
class Recorded:
    method: str
    path: str
    headers: dict
    body: Any
    status: int = 200
    main: bool | None = None
    usage: dict | None = None
    time: float = field(default_factory=time.time)


def _chunks(s: str, n: int) -> list[str]:
    return [s[i:i + n] for i in range(0, len(s), n)] or [""]


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _err(status: int, type_: str, msg: str) -> JSONResponse:
    return JSONResponse(APIError(status, type_, msg).body(), status_code=status,
                        headers={"x-should-retry": "false"})


class ScriptedAPI:
    MODELS = ("claude-opus-5-5", "claude-sonnet-5", "claude-haiku-4-5")

    def __init__(self, policy: Policy | Sequence[Step], *, host: str = "127.0.0.1", port: int = 0,
                 verbose: bool = False):
        self.policy: Policy = policy if callable(policy) else tool_sequence(policy)
        self.host, self.port, self.verbose = host, port, verbose
        self._lock = threading.Lock()
        self._log: list[Recorded] = []
        self._errors: list[BaseException] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        routes = [
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
            Route("/api/hello", self._hello, methods=["GET", "HEAD"]),
            Route("/{rest:path}", self._unknown,
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
        ]
        self.app = Starlette(routes=routes)

    # ---- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ScriptedAPI":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"ScriptedAPI:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("ScriptedAPI did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(5)
        self._server = self._thread = None

    def __enter__(self) -> "ScriptedAPI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def claude_env(self, **extra: str) -> dict[str, str]:
        """Environment for the Claude Code CLI (e.g. ClaudeAgentOptions(env=...))."""
        return {"ANTHROPIC_BASE_URL": self.url, "ANTHROPIC_API_KEY": "dummy",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                "ENABLE_TOOL_SEARCH": "false", **extra}

    # ---- records
    @property
    def log(self) -> list[Recorded]:
        with self._lock:
            return list(self._log)

    @property
    def requests(self) -> list[dict]:
        return [r.body for r in self.log if r.path == "/v1/messages"]

    @property
    def main_requests(self) -> list[dict]:
        return [r.body for r in self.log if r.path == "/v1/messages" and r.main]

    @property
    def unknown(self) -> list[Recorded]:
        return [r for r in self.log if r.status == 404]

    @property
    def errors(self) -> list[BaseException]:
        with self._lock:
            return list(self._errors)

    @property
    def usage(self) -> dict[str, int]:
        tot = {"requests": 0, "input_tokens": 0, "output_tokens": 0}
        for r in self.log:
            if r.usage:
                tot["requests"] += 1
                tot["input_tokens"] += r.usage["input_tokens"]
                tot["output_tokens"] += r.usage["output_tokens"]
        return tot

    def _record(self, request: Request, body: Any, **kw: Any) -> Recorded:
        rec = Recorded(request.method, request.url.path, dict(request.headers), body, **kw)
        with self._lock:
            self._log.append(rec)
        if self.verbose:
            print(f"[ScriptedAPI] {rec.method} {rec.path} -> {rec.status} main={rec.main}", flush=True)
        return rec

    @staticmethod
    async def _json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode("utf-8", "replace")

    # ---- endpoints
    async def _messages(self, request: Request) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            self._record(request, body, status=400)
            return _err(400, "invalid_request_error", "body must be a JSON object")
        is_main = getattr(self.policy, "is_main", None)
        main = bool(is_main(body)) if is_main else None
        try:
            out = self.policy(body)
            if isinstance(out, str):
                out = Reply(text=out)
            if not isinstance(out, (Reply, APIError)):
                raise TypeError(f"policy returned {out!r}")
        except Exception as exc:  # surface script bugs without retries
            with self._lock:
                self._errors.append(exc)
            out = APIError(400, "invalid_request_error", f"scripted policy raised: {exc!r}")
        if isinstance(out, APIError):
            self._record(request, body, status=out.status, main=main)
            headers = {"x-should-retry": "true" if out.retryable else "false"}
            return JSONResponse(out.body(), status_code=out.status, headers=headers)
        if out.delay:
            await asyncio.sleep(out.delay)

        content: list[dict] = []
        if out.text is not None and (out.text or not out.tool_calls):
            content.append({"type": "text", "text": out.text})
        for c in out.tool_calls:
            content.append({"type": "tool_use", "id": c.id or f"{_STEP_ID}x_{uuid.uuid4().hex[:12]}",
                            "name": c.name, "input": c.input})
        stop = out.stop_reason or ("tool_use" if out.tool_calls else "end_turn")
        usage = {"input_tokens": rough_tokens(body), "output_tokens": rough_tokens(content),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        self._record(request, body, main=main, usage=usage)
        msg = {"id": f"msg_scripted_{uuid.uuid4().hex[:16]}", "type": "message", "role": "assistant",
               "model": body.get("model") or self.MODELS[0], "content": content,
               "stop_reason": stop, "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return JSONResponse(msg)

        async def events():
            yield _sse("message_start", {"type": "message_start", "message": {
                **msg, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})
            yield _sse("ping", {"type": "ping"})
            for i, block in enumerate(content):
                if block["type"] == "text":
                    start, deltas = {"type": "text", "text": ""}, [
                        {"type": "text_delta", "text": p} for p in _chunks(block["text"], 32)]
                else:
                    start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                    deltas = [{"type": "input_json_delta", "partial_json": p}
                              for p in [""] + _chunks(json.dumps(block["input"]), 32)]
                yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": start})
                for d in deltas:
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": i})
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": usage["output_tokens"]}})
            yield _sse("message_stop", {"type": "message_stop"})

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "request-id": "req_scripted"})

    async def _count_tokens(self, request: Request) -> Response:
        body = await self._json(request)
        self._record(request, body)
        keys = ("system", "messages", "tools")
        return JSONResponse({"input_tokens": rough_tokens(
            {k: body.get(k) for k in keys} if isinstance(body, dict) else body)})

    def _model_info(self, model_id: str) -> dict:
        return {"type": "model", "id": model_id, "display_name": model_id,
                "created_at": "2025-01-01T00:00:00Z"}

    async def _models(self, request: Request) -> Response:
        self._record(request, None)
        data = [self._model_info(m) for m in self.MODELS]
        return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"],
                             "last_id": data[-1]["id"]})

    async def _model(self, request: Request) -> Response:
        self._record(request, None)
        return JSONResponse(self._model_info(request.path_params["model_id"]))

    async def _hello(self, request: Request) -> Response:
        self._record(request, None)
        return Response("" if request.method == "HEAD" else "OK", media_type="text/plain")

    async def _unknown(self, request: Request) -> Response:
        self._record(request, await self._json(request), status=404)
        return _err(404, "not_found_error", f"scripted API: no route {request.method} {request.url.path}")
