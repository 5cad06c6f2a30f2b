"""The MCP server: the persistent engine as tools, for one agent.

    tkcc mcp [--engine URL] [--agent-id ID] [--http PORT]         (stdio by default; cli.py)
    build_server(lambda: (url, token_file), agent_id="a1").run()   (in-process)

One server per agent, stateless apart from its agent id, which every engine call carries
as the `X-Agent-Id` header so the ledger records who asked. The tools are the engine's RPC
methods of the same names: `read_engine_source`, `submit_forward_pass`,
`measure_fast`, `measure_full`, `check_bit_exact`, plus `leaderboard`, `candidate_source`
and `traffic_profile`. Each returns a pydantic model: structured output, and the same JSON
as text (Claude Code shows the agent the structured output).

Expected failures are results: a candidate that does not install, raises, hangs, kills
the worker or is not exact comes back with `ok`/`exact` false and an `error` naming the
stage. Tool errors (`is_error`) are for the caller's mistakes (a path outside the
snapshot, an unknown candidate) and for an engine that cannot be reached; their message
says what happened. Nothing here writes to stdout: in stdio mode it carries the protocol.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine_server.client import EngineClient, EngineUnavailable, state_dir
from engine_server.log import get_logger
from engine_server.server import check_loopback
from engine_server.results import ExactResult, InstallResult, MeasureResult
from tkcc_mcp import launch

log = get_logger("mcp")

PROGRESS_EVERY_S = 5.0
Locate = Callable[[], "tuple[str, str | Path]"]  # -> (engine url, token file); may start an engine

INSTRUCTIONS = """\
tkcc: a persistent LLM inference engine you make faster by rewriting its forward pass.
1. read_engine_source() lists the engine's source and names the reference forward pass; read it.
2. Write a candidate: one Python module defining forward(state, batch) -> logits [B, vocab]
   (optionally prepare(state)); it may import the reference module for parts it leaves alone.
3. submit_forward_pass(source) installs it in the running engine and returns a candidate_id.
4. check_bit_exact(candidate_id): bitwise-exact outputs are the gate; inexact speed counts for nothing.
5. measure_fast(candidate_id): seconds; A/B speedup over the reference with a 95% interval.
6. measure_full(candidate_id): several times the fast tier's cost; confirms on a traffic replay.
leaderboard, candidate_source and traffic_profile help choose what to try next.
"""

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)  # no engine state changes
CandidateId = Annotated[str, Field(description="the id submit_forward_pass returned, e.g. 'c0007' "
                                               "('reference' is the engine's own forward pass)")]


# ---- result models of the extra tools (the engine's own models cover the five) --------------

class SourceFile(BaseModel):
    path: str
    lines: int


class SourceView(BaseModel):
    """No path: `files`, `reference_forward`, `hint`. A path: numbered lines in `text`."""
    files: list[SourceFile] | None = Field(None, description="the snapshot's files and their line counts")
    reference_forward: str | None = Field(None, description="the file with the loaded model's reference "
                                                            "forward pass: read it first")
    hint: str | None = None
    path: str | None = None
    start_line: int | None = None
    end_line: int | None = None
    total_lines: int | None = None
    truncated: bool | None = Field(None, description="more lines follow: read again from end_line + 1")
    text: str | None = Field(None, description="the lines, each as '<number>  <line>'")


class LeaderRow(BaseModel):
    candidate_id: str
    name: str | None = None
    agent_id: str | None = None
    parent: str | None = None
    speedup: float | None = Field(None, description="best speedup over the reference on this tier")
    n_measurements: int = 0
    exact: bool | None = Field(None, description="latest check_bit_exact: true, false, or null if never checked")


class Leaderboard(BaseModel):
    tier: str
    rows: list[LeaderRow]


class CandidateSource(BaseModel):
    candidate_id: str
    name: str | None = None
    parent: str | None = None
    agent_id: str | None = None
    stage: str | None = Field(None, description="last install stage reached ('ready' = installed)")
    source: str


class TrafficProfile(BaseModel):
    source: str = Field(description="the trace file")
    profile: dict[str, Any] = Field(description="requests, arrival rate, concurrency, prompt_len and "
                                                "output_len percentiles")
    fast_shapes: list[str] = Field(description="the decode batches the fast tier times")
    fast_layers: list[int] = Field(description="the layers the fast tier runs")
    full_tier: dict[str, Any] = Field(description="the full tier's replay: requests, length caps, speed")


# ---- the link to the engine (the lifespan context) ------------------------------------------

class EngineLink:
    """The engine this server calls. Found (or started) in the background at start-up, so the
    MCP handshake never waits for an engine that is loading weights; a tool call waits."""

    def __init__(self, locate: Locate, agent_id: str | None):
        self.locate, self.agent_id = locate, agent_id
        self._client: EngineClient | None = None
        self._lock = anyio.Lock()

    async def client(self) -> EngineClient:
        async with self._lock:
            if self._client is None:
                try:
                    url, token_file = await anyio.to_thread.run_sync(self.locate, abandon_on_cancel=True)
                    self._client = EngineClient.from_url(url, token_file, agent_id=self.agent_id)
                except Exception as e:  # noqa: BLE001 - no engine: every tool says why
                    raise ToolError(f"no engine to call: {type(e).__name__}: {e}") from None
            return self._client

    async def warm(self) -> None:
        try:
            await self.client()
        except ToolError as e:
            log.error("engine not available; tools will retry", error=str(e))

    async def call(self, ctx: Context | None, method: str, **params) -> dict:
        """One engine RPC, with progress notifications while it runs (for clients that asked)."""
        out: dict | None = None
        err: Exception | None = None
        async with anyio.create_task_group() as tg:
            if ctx is not None:
                tg.start_soon(_heartbeat, ctx, method)
            try:
                out = await (await self.client()).acall(method, **params)
            except EngineUnavailable as e:
                self._client = None  # next call looks again (an auto-started engine is found or restarted)
                err = ToolError(f"the engine did not answer {method}: {e}")
            except ToolError as e:
                err = e
            tg.cancel_scope.cancel()
        if err is not None:
            raise err
        return out


async def _heartbeat(ctx: Context, method: str) -> None:
    t0 = time.monotonic()
    while True:
        await anyio.sleep(PROGRESS_EVERY_S)
        s = time.monotonic() - t0
        try:
            await ctx.report_progress(s, None, f"{method}: running for {s:.0f} s")
        except Exception:  # noqa: BLE001 - progress is best effort
            return


def _as(model: type[BaseModel], d: dict) -> Any:
    """The engine's result dict as its model (extra keys such as `worker_restarted` are dropped:
    the error message says so); a dict that is not one is the engine refusing the call."""
    try:
        return model.model_validate(d)
    except ValidationError:
        raise ToolError(str(d.get("error") or d)) from None


def _result(model: type[BaseModel], d: dict) -> Any:
    """A measurement's or check's result; one for a candidate the engine does not have (error
    stage "lookup") is the caller's mistake, a tool error like any other."""
    err = d.get("error") if isinstance(d, dict) else None
    if isinstance(err, dict) and err.get("stage") == "lookup":
        raise ToolError(err.get("message") or "unknown candidate")
    return _as(model, d)


def _link(ctx: Context) -> EngineLink:
    return ctx.request_context.lifespan_context


# ---- the server -----------------------------------------------------------------------------

def build_server(locate: Locate, agent_id: str | None = None, warm: bool = True) -> MCPServer:
    """An MCP server whose tools call the engine `locate()` returns, as `agent_id`."""

    @asynccontextmanager
    async def lifespan(app: MCPServer):
        link = EngineLink(locate, agent_id)
        async with anyio.create_task_group() as tg:
            if warm:
                tg.start_soon(link.warm)  # find or start the engine now, not at the first call
            yield link
            tg.cancel_scope.cancel()

    server = MCPServer("tkcc", instructions=INSTRUCTIONS, lifespan=lifespan, log_level="WARNING")

    @server.tool(annotations=READ_ONLY)
    async def read_engine_source(
        ctx: Context,
        path: Annotated[str | None, Field(description="a file from the listing, e.g. "
                                                      "'engine_server/models/llama.py'; omit to list")] = None,
        start_line: Annotated[int | None, Field(description="first line, 1-based (default 1)")] = None,
        end_line: Annotated[int | None, Field(description="last line, inclusive (default: the end, "
                                                          "at most 400 lines per call)")] = None,
    ) -> SourceView:
        """Read the engine's raw source: the files a forward pass sees and is judged by.

        With no path: lists the snapshot's files with their line counts, and names
        `reference_forward`, the file holding the loaded model's reference forward pass:
        read it first, it is what you are rewriting. With a path as listed: returns the
        numbered lines start_line..end_line (at most 400 per call; `truncated` says more
        follow). Only files inside the snapshot can be read (no '..', no absolute paths).
        Instant and free; reading measure.py and exact.py tells you exactly how you are judged.
        """
        d = await _link(ctx).call(ctx, "read_engine_source", path=path, start_line=start_line,
                                  end_line=end_line)
        if not d.get("ok"):
            raise ToolError(d.get("error") or "read failed")
        return _as(SourceView, d)

    @server.tool()
    async def submit_forward_pass(
        ctx: Context,
        source: Annotated[str, Field(description="the full text of a Python module defining "
                                                 "forward(state, batch) and optionally prepare(state)")],
        name: Annotated[str | None, Field(description="a short label for the leaderboard, e.g. "
                                                      "'fused-qkv'")] = None,
        parent: Annotated[str | None, Field(description="the candidate_id this one improves on "
                                                        "(lineage in the ledger)")] = None,
    ) -> InstallResult:
        """Install a candidate forward pass in the running engine; returns its candidate_id.

        `source` is one Python module that defines `forward(state, batch) -> logits`, a
        tensor [B, vocab] holding the logits of the last position of each batch row, and
        may define `prepare(state)`, run once at install to build derived tensors (packed or
        fused weights, tables) into `state.scratch` within a memory budget. It may import
        the reference module (`engine_server.models.<family>`, named by
        read_engine_source()) and call it for the parts it leaves alone, and may use torch
        ops, Triton, torch.compile or inline CUDA. Rules: never write to `state.weights`;
        write K/V only into the cache cells the batch names; keep nothing across calls.

        Installing parses, imports, validates, runs prepare, warms up (a prefill and a
        decode) and captures CUDA graphs, without restarting the engine: seconds (more with
        torch.compile). Returns `ok` and `stage`, the last stage reached (parsed, imported,
        validated, prepared, warmed, captured, ready); on failure `error` gives the stage,
        the exception and a short traceback with your lines. A candidate that hangs is
        stopped by the engine's timeout; one that kills the worker costs a worker restart
        (the error says so). Next: check_bit_exact and measure_fast with the candidate_id.
        """
        return _as(InstallResult, await _link(ctx).call(ctx, "submit_forward_pass", source=source,
                                                        name=name, parent=parent))

    @server.tool()
    async def measure_fast(ctx: Context, candidate_id: CandidateId) -> MeasureResult:
        """Fast-tier speed of a candidate: cheap (seconds), for comparing ideas quickly.

        Times the decode step on a subset of the layers (about a fifth) over a few batch
        shapes taken from the engine's traffic, reference and candidate alternated A/B in
        the same call, warm-up dropped; full depth is extrapolated from the subset and from
        no layers, and checked against full-depth steps timed in rounds drawn at random
        (timed again before a pass is flagged: one whose time does not grow with its layers
        is). Returns `speedup` =
        reference time / candidate time (above 1 is faster) and `speedup_ci95`, its 95%
        interval: a gain is real when the whole interval is above 1. Rounds stop early once
        that interval is narrow enough (`samples` says how many ran). Also step_ms,
        tokens_per_s, per-shape timings, and `outputs_match`, the timed outputs against the
        reference's: a candidate that is fast only while timed is flagged (`valid` false,
        `violations`). Speed counts only for a candidate check_bit_exact calls exact.
        """
        return _result(MeasureResult, await _link(ctx).call(ctx, "measure_fast", candidate_id=candidate_id))

    @server.tool()
    async def measure_full(ctx: Context, candidate_id: CandidateId) -> MeasureResult:
        """Full-tier speed of a candidate: all layers on a replay of the traffic trace.

        Costs several times the fast tier (tens of seconds or more on a GPU): use it to
        confirm a candidate that is exact and wins the fast tier. Reference and candidate
        replay the same schedule A/B in the same call. Returns `speedup` with
        `speedup_ci95`, per-user tokens/s at P50 and P90, time to first token, throughput
        for both sides, and `tokens_match` (share of replay steps whose greedy token equals
        the reference's).
        """
        return _result(MeasureResult, await _link(ctx).call(ctx, "measure_full", candidate_id=candidate_id))

    @server.tool()
    async def check_bit_exact(
        ctx: Context,
        candidate_id: CandidateId,
        mode: Annotated[Literal["bitwise", "tolerance"],
                        Field(description="bitwise (the gate) or tolerance (information only)")] = "bitwise",
    ) -> ExactResult:
        """Compare a candidate's outputs with the reference's: the gate every candidate must pass.

        Both sides run from cloned identical state (unused KV cells filled with large noise,
        so out-of-bounds reads show) through a prefill and several greedy decode steps (all
        rows together, then the first row alone), on all layers and on the fast tier's
        subset. Bitwise means torch.equal on the logits, the greedy tokens and the KV cache.
        Seconds. Returns `exact`; when false,
        `first_mismatch` (phase, step, row, vocab index, both values), `max_abs_diff`,
        `tokens_equal`, `kv_equal`, `token_divergence` (where the greedy tokens first differ,
        with each side's logit gap there and whether it was a near tie) and any
        `violations` (writing to weights, results kept across calls, ...).
        mode='tolerance' also reports `close`: on every step the candidate is no further
        from the reference run in a wider dtype (float32 for bf16) than twice the
        reference's own error, with identical greedy tokens. For
        information only: it never makes a candidate exact.
        """
        return _result(ExactResult, await _link(ctx).call(ctx, "check_bit_exact", candidate_id=candidate_id,
                                                          mode=mode))

    @server.tool(annotations=READ_ONLY)
    async def leaderboard(
        ctx: Context,
        tier: Annotated[Literal["fast", "full"], Field(description="which measurement ranks")] = "fast",
        limit: Annotated[int, Field(ge=1, le=100, description="rows to return")] = 10,
    ) -> Leaderboard:
        """The best candidates so far, from every agent on this engine, best first.

        Per candidate: its best speedup on the tier, how often it was measured, and `exact`
        from its latest exactness check (null if never checked). Instant. Pick a strong
        exact one, read it with candidate_source, and improve it (parent=its id).
        """
        d = await _link(ctx).call(ctx, "leaderboard", tier=tier, limit=limit)
        return _as(Leaderboard, d)

    @server.tool(annotations=READ_ONLY)
    async def candidate_source(ctx: Context, candidate_id: CandidateId) -> CandidateSource:
        """The source of a submitted candidate (any agent's), with its name, parent, agent and
        install stage. Instant."""
        return _as(CandidateSource, await _link(ctx).call(ctx, "candidate_source", candidate_id=candidate_id))

    @server.tool(annotations=READ_ONLY)
    async def traffic_profile(ctx: Context) -> TrafficProfile:
        """What the engine measures on: the traffic trace (prompt and output length
        percentiles, arrival rate, concurrency), the batch shapes and layers the fast tier
        times, and the full tier's replay settings. Instant. Optimise for these shapes."""
        return _as(TrafficProfile, await _link(ctx).call(ctx, "traffic_profile"))

    _refuse_unknown_arguments(server)
    return server


def _refuse_unknown_arguments(server: MCPServer) -> None:
    """Every tool refuses an argument it does not take, naming it: a misspelt optional one
    (`check_bit_exact(mod="tolerance")`) would otherwise run with its default unnoticed. Each
    tool's argument model forbids extra fields and its input schema says so
    (additionalProperties: false), for clients that check before they call."""
    for tool in server._tool_manager.list_tools():
        base = tool.fn_metadata.arg_model
        config = ConfigDict(**{**base.model_config, "extra": "forbid"})
        tool.fn_metadata.arg_model = type(base.__name__, (base,), {"model_config": config})
        tool.parameters["additionalProperties"] = False


# ---- entry point (`tkcc mcp`) ---------------------------------------------------------------

def run(engine: str | None = None, token_file: str | None = None, home: str | None = None,
        agent_id: str | None = None, http: int | None = None, host: str = "127.0.0.1",
        model: str = "llama-3.2-1b", shrink: bool | None = None, device: str | None = None,
        start_timeout_s: float = 900.0) -> int:
    """Serve until the client goes away (stdio) or SIGINT/SIGTERM (HTTP)."""
    agent_id = agent_id or f"mcp-{os.getpid()}"
    if http is not None:
        try:
            check_loopback(host)
        except ValueError as e:
            print(f"tkcc mcp: {e}", file=sys.stderr)
            return 2
    if engine:
        tf = Path(token_file) if token_file else state_dir(home) / "engine.token"
        if not tf.is_file():
            print(f"tkcc mcp: no token file {tf} for --engine {engine} (give --token-file)", file=sys.stderr)
            return 2
        locate: Locate = lambda: (engine, tf)  # noqa: E731
    else:
        def locate():
            return launch.ensure_engine(home, model=model, shrink=shrink, device=device,
                                        timeout_s=start_timeout_s)
    server = build_server(locate, agent_id)
    log.info("mcp server", agent=agent_id, engine=engine or f"auto ({state_dir(home)})",
             transport=f"http {host}:{http}" if http is not None else "stdio")
    try:
        if http is None:
            server.run()
        else:
            print(f"tkcc mcp: streamable HTTP on http://{host}:{http}/mcp (agent {agent_id})",
                  file=sys.stderr, flush=True)
            server.run("streamable-http", host=host, port=http)
    except KeyboardInterrupt:
        pass
    return 0
