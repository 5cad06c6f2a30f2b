"""Serving: an OpenAI-compatible HTTP API over the engine's promoted (active) forward pass.

    tkcc serve --model llama-3.2-1b --shrink --device cpu --port 8000 [--continual]

Contract
--------
* Loopback only. `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`:
  server-sent events, `data: {...}` chunks, then `data: [DONE]`), `GET /v1/models`,
  `GET /health`, `GET /metrics` (Prometheus text format).
* One in-process `Engine`; a scheduler thread does continuous batching over its KV slots
  (`0 .. max_batch-1`; the engine's padding slot is never used for a request): each step
  it admits waiting requests into free slots, one prefill each, then decodes every running
  row together in one forward call. Greedy when `temperature == 0`, else temperature (and
  `top_p`) sampling with a per-request generator (`seed`). A request ends at `max_tokens`
  (`finish_reason` "length") or at the model's eos token ("stop", unless `ignore_eos`).
  `max_tokens` is clamped to the room left in the slot (`max_seq - prompt_len`); a prompt
  that does not fit is a 400.
* Tokenization: prompts with the engine's `TrafficData` tokenizer (the model directory's
  `tokenizer.json` when there is one, else the deterministic fallback); `prompt` may also
  be a list of token ids. Output text: decoded with the model's own tokenizer when present;
  the fallback tokenizer has no decoder, so each token is written as `<id>` (e.g.
  `<17><1029>`). Chat messages become `role: content` lines followed by `assistant: `.
* Hot swap: `Service.promote(source)` installs a forward pass into the serving engine
  (`submit_forward_pass`) and makes it active between two scheduler steps, under the
  scheduler's lock; requests in flight continue on the new pass (promotion requires it to
  be bitwise exact, so their KV cache stays valid). Serving pauses for the install (a warm-up
  on the padding slot; on CUDA, graph capture). `Service.rollback(to)` swaps back. A forward
  pass that raises while serving is rolled back to the reference and the step is re-run, so
  its requests do not fail; both are ledger events.
* Every finished request is one JSON line in the serving log (`traffic.read_trace` reads it
  back, format `serving_log`): `arrival_s`, `prompt_len`, `output_len` (tokens generated),
  `ttft_s`, `first_token_s`, `finish_s` (server clock, seconds from start), `finish_reason`,
  `forward_passes`, `mean_batch` (mean decode rows the request shared a step with), and for
  MoE models `experts` (routing counts per expert id, summed over layers and the tokens
  observed: every token on the eager path from `batch.expert_log`; when the active pass
  records nothing, or runs under CUDA graphs, an eager reference probe of every
  `expert_probe_every`-th decode step. The probe rewrites the step's K/V cells with the
  values the active pass wrote, since that pass is bitwise exact).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine_server.config import EngineConfig
from engine_server.log import get_logger
from engine_server.server import check_loopback

if TYPE_CHECKING:  # torch and the engine load when a Service is built: `tkcc --help` stays light
    import torch

    from engine_server.engine import Engine
    from engine_server.state import Batch

log = get_logger("serving")

REFERENCE = "reference"  # engine.REFERENCE, the candidate id of the reference forward pass


@dataclass
class ServeConfig:
    """`tkcc serve` flags besides the engine's (underscores become dashes)."""
    host: str = "127.0.0.1"  # loopback only
    port: int = 8000  # 0 picks a free port
    home: str = ""  # ledger and serving log directory (default $TKCC_HOME or ~/.tkcc)
    serving_log: str = ""  # JSONL, one line per request (default <home>/serving.jsonl)
    default_max_tokens: int = 16
    expert_probe_every: int = 8  # MoE: probe routing every N decode steps when the pass records none
    step_history: int = 4096  # decode steps kept for /metrics and the canary
    recent_requests: int = 2048  # finished request records kept in memory for drift windows
    continual: bool = False  # watch traffic, recompile on drift, promote, roll back (tkcc_mcp.continual)


class RequestError(ValueError):
    """A request the server refuses (400): the message is the API's error message."""


# ---- metrics -----------------------------------------------------------------------------

class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}',
                f"{name}_sum{{{labels}}} {self.sum:.6f}" if labels else f"{name}_sum {self.sum:.6f}",
                f"{name}_count{{{labels}}} {self.count}" if labels else f"{name}_count {self.count}"]
        return out


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """Counters and histograms of the serving process; `render()` is the Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status)
        self.prompt_tokens = self.generation_tokens = self.decode_steps = 0
        self.promotions = self.rollbacks = 0
        self.ttft, self.e2e = Histogram(LATENCY_BUCKETS), Histogram(LATENCY_BUCKETS)
        self.tpot, self.step = Histogram(STEP_BUCKETS), Histogram(STEP_BUCKETS)
        self.rows = Histogram(ROW_BUCKETS)
        self.max_rows = 0
        self.experts_active = Histogram(tuple(float(2 ** i) for i in range(9)))

    def request(self, endpoint: str, status: str) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    @property
    def failures(self) -> int:
        """Requests the server failed (status "error"); refusals (4xx) and cancels are counted apart."""
        return sum(n for (_, s), n in self.requests.items() if s == "error")

    def render(self, active: str, running: int, waiting: int) -> str:
        with self.lock:
            out = ["# HELP tkcc_requests_total Requests answered, by endpoint and status.",
                   "# TYPE tkcc_requests_total counter"]
            out += [f'tkcc_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())]
            out += ["# HELP tkcc_request_failures_total Requests the server failed (refusals and cancels excluded).",
                    "# TYPE tkcc_request_failures_total counter", f"tkcc_request_failures_total {self.failures}",
                    "# TYPE tkcc_prompt_tokens_total counter", f"tkcc_prompt_tokens_total {self.prompt_tokens}",
                    "# TYPE tkcc_generation_tokens_total counter",
                    f"tkcc_generation_tokens_total {self.generation_tokens}",
                    "# TYPE tkcc_decode_steps_total counter", f"tkcc_decode_steps_total {self.decode_steps}",
                    "# TYPE tkcc_promotions_total counter", f"tkcc_promotions_total {self.promotions}",
                    "# TYPE tkcc_rollbacks_total counter", f"tkcc_rollbacks_total {self.rollbacks}",
                    "# HELP tkcc_active_forward_pass The forward pass serving requests (value 1).",
                    "# TYPE tkcc_active_forward_pass gauge", f'tkcc_active_forward_pass{{candidate_id="{active}"}} 1',
                    "# TYPE tkcc_running_requests gauge", f"tkcc_running_requests {running}",
                    "# TYPE tkcc_waiting_requests gauge", f"tkcc_waiting_requests {waiting}",
                    "# TYPE tkcc_decode_rows_max gauge", f"tkcc_decode_rows_max {self.max_rows}"]
            for name, h, what in (("tkcc_time_to_first_token_seconds", self.ttft, "arrival to first token"),
                                  ("tkcc_e2e_request_latency_seconds", self.e2e, "arrival to last token"),
                                  ("tkcc_time_per_output_token_seconds", self.tpot, "per token after the first"),
                                  ("tkcc_decode_step_seconds", self.step, "one decode forward call"),
                                  ("tkcc_decode_batch_rows", self.rows, "rows in one decode step"),
                                  ("tkcc_experts_active_per_layer", self.experts_active,
                                   "MoE: distinct experts per layer in an observed decode step")):
                if h.count or name != "tkcc_experts_active_per_layer":
                    out += [f"# HELP {name} {what}.", f"# TYPE {name} histogram"] + h.lines(name)
        return "\n".join(out) + "\n"


# ---- requests and the scheduler ------------------------------------------------------------

@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    endpoint: str = "completions"
    emit: Callable[[tuple], None] = lambda ev: None  # ("token", id) | ("done", reason) | ("error", msg)
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    # set by the scheduler
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    out: list[int] = field(default_factory=list)
    slot: int | None = None
    cancelled: bool = False
    rows_sum: int = 0
    steps: int = 0
    passes: set = field(default_factory=set)
    experts: torch.Tensor | None = None  # [E] int64 routing counts
    gen: torch.Generator | None = None


@dataclass(frozen=True)
class StepRecord:
    t: float  # server clock at the end of the step
    rows: int
    seconds: float  # the forward call alone
    forward_pass: str


class Scheduler:
    """Continuous batching over the engine's KV slots; one thread calls `run()`.

    `lock` is held for a whole step, so whoever holds it (a swap, an install) acts between
    two steps. `on_finish(req)` is called on the scheduler thread for every finished request."""

    def __init__(self, engine: Engine, metrics: Metrics, on_finish: Callable[[GenRequest], None],
                 expert_probe_every: int = 8, history: int = 4096, on_failure: Callable | None = None):
        self.eng, self.metrics, self.on_finish, self.on_failure = engine, metrics, on_finish, on_failure
        self.lock = threading.RLock()
        self.cv = threading.Condition()
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.running: dict[int, GenRequest] = {}
        self.free = list(range(engine.config.max_batch))
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.t0 = time.monotonic()
        self.active = engine.active
        self.probe_every = max(1, expert_probe_every)
        self.moe = engine.model.is_moe
        self.eos = engine.model.eos_token_id
        self._states: dict[str, object] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._n = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- outside the scheduler thread --

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tkcc-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        with self.cv:
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, req: GenRequest) -> None:
        room = self.eng.state.max_seq - len(req.prompt)
        if self._stop:
            raise RequestError("the server is shutting down")
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if room < 1:
            raise RequestError(f"the prompt has {len(req.prompt)} tokens; this server's maximum context "
                               f"length is {self.eng.state.max_seq} (prompt and output)")
        if req.max_tokens < 1:
            raise RequestError("max_tokens must be >= 1")
        req.max_tokens = min(req.max_tokens, room)
        if req.temperature > 0:
            import torch
            req.gen = torch.Generator().manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
        req.arrival_s = self.now()
        with self.cv:
            self.waiting.append(req)
            self.cv.notify()

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True  # the scheduler frees its slot at the next step

    def swap(self, candidate_id: str) -> str:
        """Make an installed candidate the serving pass between two steps; returns the previous one."""
        with self.lock:
            r = self.eng.rollback(candidate_id)
            if not r.get("ok"):
                raise KeyError(r.get("error"))
            prev, self.active = self.active, candidate_id
            self._states.clear()
            return prev

    def counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    # -- the scheduler thread --

    def run(self) -> None:
        while not self._stop:
            with self.cv:
                while not self._stop and not self.waiting and not self.running:
                    self.cv.wait(0.5)
            if self._stop:
                break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - our bug: fail the requests in hand, keep serving
                log.exception("scheduler step failed")
                with self.lock:
                    for slot, req in list(self.running.items()):
                        self._finish(req, "error", error=f"{type(e).__name__}: {e}")
        with self.lock:  # shutting down: nothing is dropped silently
            for req in list(self.running.values()) + list(self.waiting):
                self._finish(req, "error", error="the server is shutting down")
            self.waiting.clear()

    def step(self) -> None:
        with self.lock:
            while self.free:
                with self.cv:
                    req = self.waiting.popleft() if self.waiting else None
                if req is None:
                    break
                if req.cancelled:
                    self._finish(req, "cancelled")
                    continue
                req.slot = self.free.pop(0)
                self.running[req.slot] = req
                self._prefill(req)
            for req in [r for r in self.running.values() if r.cancelled]:
                self._finish(req, "cancelled")
            if self.running:
                self._decode(sorted(self.running.values(), key=lambda r: r.slot))

    def _state(self, cid: str):
        st = self._states.get(cid)
        if st is None:
            st = self._states[cid] = self.eng.candidate_state(self.eng.candidates[cid])
        return st

    def _forward(self, batch: Batch, rows: int) -> torch.Tensor:
        """The active pass on `batch` (its CUDA graph for decode when captured). A pass that raises
        is rolled back to the reference and the call re-run (same cells, bitwise the same K/V), as
        is one whose output breaks the contract (`measure.output`)."""
        from engine_server.measure import output
        cand = self.eng.candidates[self.active]
        try:
            if cand.graphs is not None and batch.seq_len == 1:
                out = cand.graphs.run(self._state(cand.id), batch)
            else:
                out = cand.forward(self._state(cand.id), batch)
            return output(self.eng, out, batch)[:rows]
        except Exception as e:  # noqa: BLE001 - the candidate's failure, not the requests'
            if self.active == REFERENCE:
                raise
            failed = self.active
            self.swap(REFERENCE)
            self.metrics.rollbacks += 1
            log.warning("active forward pass raised; rolled back to the reference", candidate=failed,
                        error=f"{type(e).__name__}: {e}")
            if self.on_failure is not None:
                self.on_failure(failed, e)
            batch.expert_log = [] if batch.expert_log is not None else None
            return self._forward(batch, rows)

    def _prefill(self, req: GenRequest) -> None:
        import torch

        from engine_server.state import prefill_batch
        dev = self.eng.device
        batch = prefill_batch(torch.tensor([req.prompt], device=dev), torch.tensor([req.slot], device=dev))
        batch.expert_log = [] if self.moe else None
        with torch.inference_mode():
            logits = self._forward(batch, 1)
        if batch.expert_log:
            req.experts = _add(req.experts, _route_counts(batch.expert_log, self.eng.model.num_experts).sum(0))
        self.metrics.prompt_tokens += len(req.prompt)
        req.passes.add(self.active)
        self._emit(req, self._sample(logits, [req])[0])

    def _decode(self, reqs: list[GenRequest]) -> None:
        import torch

        from engine_server.state import Batch, decode_batch
        n, dev, eng = len(reqs), self.eng.device, self.eng
        tokens = [r.out[-1] for r in reqs]
        positions = [len(r.prompt) + len(r.out) - 1 for r in reqs]
        slots = [r.slot for r in reqs]
        graphed = eng.candidates[self.active].graphs is not None
        if graphed:  # pad to a captured size with rows on the padding slot
            size = next((s for s in eng.graph_sizes if s >= n), n)
            tokens, positions, slots = (tokens + [0] * (size - n), positions + [1] * (size - n),
                                        slots + [eng.pad_slot] * (size - n))
        batch = decode_batch(*(torch.tensor(x, device=dev) for x in (tokens, positions, slots)))
        batch.expert_log = [] if self.moe and not graphed else None
        active = self.active
        with torch.inference_mode():
            if eng.cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            logits = self._forward(batch, n)
            if eng.cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            self._n += 1
            if self.moe and not batch.expert_log and self._n % self.probe_every == 0:
                probe = Batch(batch.tokens, batch.positions, batch.slots, [])
                eng.family.forward(self._state(REFERENCE), probe)
                batch.expert_log = probe.expert_log
        self.steps.append(StepRecord(self.now(), n, dt, active))
        m = self.metrics
        m.decode_steps += 1
        m.step.observe(dt)
        m.rows.observe(n)
        m.max_rows = max(m.max_rows, n)
        if batch.expert_log:
            counts = _route_counts(batch.expert_log, eng.model.num_experts)  # [B, E]
            for i, r in enumerate(reqs):
                r.experts = _add(r.experts, counts[i])
            per_layer = [int(torch.unique(ids[:n]).numel()) for ids in batch.expert_log]
            m.experts_active.observe(sum(per_layer) / len(per_layer))
        for r, tok in zip(reqs, self._sample(logits, reqs)):
            r.rows_sum += n
            r.steps += 1
            r.passes.add(active)
            self._emit(r, tok)

    def _sample(self, logits: torch.Tensor, reqs: list[GenRequest]) -> list[int]:
        """logits [B, vocab] -> one token per row: argmax, or temperature/top_p sampling."""
        import torch

        from engine_server.greedy import argmax
        toks = argmax(logits).view(-1).tolist()
        for i, r in enumerate(reqs):
            if r.temperature > 0:
                probs = torch.softmax(logits[i].float().cpu() / r.temperature, -1)
                if r.top_p < 1.0:
                    p, idx = probs.sort(descending=True)
                    keep = (p.cumsum(0) - p) < r.top_p  # the smallest prefix whose mass reaches top_p
                    probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
                toks[i] = int(torch.multinomial(probs, 1, generator=r.gen))
        return toks

    def _emit(self, req: GenRequest, tok: int) -> None:
        now = self.now()
        if req.first_token_s is None:
            req.first_token_s = now
        if tok == self.eos and not req.ignore_eos:
            self._finish(req, "stop")
            return
        req.out.append(tok)
        self.metrics.generation_tokens += 1
        req.emit(("token", tok))
        if len(req.out) >= req.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: GenRequest, reason: str, error: str | None = None) -> None:
        if req.finish_reason is not None:
            return
        req.finish_s, req.finish_reason = self.now(), reason
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.free.append(req.slot)
            self.free.sort()
        req.emit(("error", error) if error else ("done", reason))
        self.on_finish(req)


def _route_counts(expert_log: list, num_experts: int) -> torch.Tensor:
    """expert_log (one [N, top_k] per MoE layer) -> [N, E] picks per token, summed over layers."""
    import torch
    ids = torch.stack([e.to("cpu") for e in expert_log])  # [L, N, k]
    one = torch.zeros(ids.shape[1], num_experts, dtype=torch.int64)
    return one.scatter_add_(1, ids.permute(1, 0, 2).reshape(ids.shape[1], -1),
                            torch.ones(ids.shape[1], ids.shape[0] * ids.shape[2], dtype=torch.int64))


def _add(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b.clone() if a is None else a + b


# ---- the serving log -----------------------------------------------------------------------

class ServingLog:
    """Append-only JSONL of finished requests (format `serving_log` of traffic.read_trace), and
    the most recent records in memory for drift windows."""

    def __init__(self, path: Path, keep: int = 2048):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.recent: collections.deque[dict] = collections.deque(maxlen=keep)
        self.count = 0

    def write(self, rec: dict) -> None:
        line = json.dumps(rec, separators=(",", ":"))
        with self.lock:
            with self.path.open("a") as f:
                f.write(line + "\n")
            self.recent.append(rec)
            self.count += 1

    def window(self, n: int) -> list[dict]:
        with self.lock:
            return list(self.recent)[-n:]


def request_record(req: GenRequest) -> dict:
    rec = {"id": req.id, "arrival_s": round(req.arrival_s, 6), "prompt_len": len(req.prompt),
           "output_len": len(req.out), "ttft_s": None if req.first_token_s is None
           else round(req.first_token_s - req.arrival_s, 6),
           "first_token_s": None if req.first_token_s is None else round(req.first_token_s, 6),
           "finish_s": round(req.finish_s, 6), "finish_reason": req.finish_reason, "endpoint": req.endpoint,
           "forward_passes": sorted(req.passes), "mean_batch": round(req.rows_sum / req.steps, 3) if req.steps else 0.0}
    if req.experts is not None:
        rec["experts"] = req.experts.tolist()
    return rec


# ---- the service -----------------------------------------------------------------------------

def detokenizer(model_dir) -> Callable[[list[int]], str]:
    """The model's own decoder when its directory has tokenizer.json (and `tokenizers` is
    installed); otherwise token ids as text, `<id>` each."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            from tokenizers import Tokenizer as HFTokenizer
            hf = HFTokenizer.from_file(str(path))
            return lambda ids: hf.decode(ids)
        except ImportError:
            pass
    return lambda ids: "".join(f"<{i}>" for i in ids)


class Service:
    """The engine, its scheduler, metrics, serving log and ledger: everything but HTTP."""

    def __init__(self, engine_config: EngineConfig, config: ServeConfig | None = None, engine: Engine | None = None):
        from engine_server.client import state_dir
        from engine_server.ledger import Ledger
        self.config = cfg = config or ServeConfig()
        if engine is None:
            from engine_server.engine import Engine
            engine = Engine(engine_config)
        self.engine = engine
        self.home = state_dir(cfg.home or None)
        self.ledger = Ledger(self.home / "ledger.db")
        self.metrics = Metrics()
        self.log = ServingLog(Path(cfg.serving_log) if cfg.serving_log else self.home / "serving.jsonl",
                              cfg.recent_requests)
        self.scheduler = Scheduler(self.engine, self.metrics, self._finished, cfg.expert_probe_every,
                                   cfg.step_history, on_failure=self._pass_failed)
        self.tokenizer = self.engine.traffic.tokenizer
        self.decode = detokenizer(self.engine.model_dir)
        self.model_names = {self.engine.model.name, self.engine.config.model, Path(self.engine.config.model).name}
        self.continual = None  # tkcc_mcp.continual.Continual when --continual
        self.started = time.time()
        self.ledger.record_event("serve_start", {"model": self.engine.model.name, "device": self.engine.config.device,
                                                 "serving_log": str(self.log.path), "active": self.scheduler.active,
                                                 "config": dataclasses.asdict(cfg)}, agent_id="serve")

    @property
    def active(self) -> str:
        return self.scheduler.active

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        if self.continual is not None:
            self.continual.stop()
        self.scheduler.stop()

    def _finished(self, req: GenRequest) -> None:
        status = "ok" if req.finish_reason in ("stop", "length") else req.finish_reason
        self.metrics.request(req.endpoint, status)
        if status != "ok":
            return
        self.metrics.e2e.observe(req.finish_s - req.arrival_s)
        if req.first_token_s is not None:
            self.metrics.ttft.observe(req.first_token_s - req.arrival_s)
            if len(req.out) > 1:
                self.metrics.tpot.observe((req.finish_s - req.first_token_s) / (len(req.out) - 1))
        self.log.write(request_record(req))

    def _pass_failed(self, cid: str, exc: BaseException) -> None:
        self.ledger.record_event("rolled_back", {"reason": "the forward pass raised while serving",
                                                 "error": f"{type(exc).__name__}: {exc}"[:2000],
                                                 "to": REFERENCE}, candidate_id=cid, agent_id="serve")

    def promote(self, source: str, name: str | None = None, parent: str | None = None,
                agent_id: str = "serve", evidence: dict | None = None) -> dict:
        """Install `source` into the serving engine and make it active between two steps.
        Returns {"ok", "candidate_id", "previous", "install"}; a failed install is a result."""
        cid = self.ledger.add_candidate(None, source, name=name, parent=parent, agent_id=agent_id)
        with self.scheduler.lock:
            r = self.engine.submit_forward_pass(source, name=name, parent=parent, candidate_id=cid)
            self.ledger.update_candidate(cid, stage=r.stage, ok=r.ok,
                                         error=None if r.error is None else f"{r.error.stage}: {r.error.type}: "
                                                                            f"{r.error.message}")
            if not r.ok:
                why = {"reason": "install into the serving engine failed",
                       "error": r.error.model_dump() if r.error else None, **(evidence or {})}
                self.ledger.record_event("candidate_rejected", why, candidate_id=cid, agent_id=agent_id)
                return {"ok": False, "candidate_id": cid, "previous": self.active, "install": r.model_dump(mode="json")}
            prev = self.scheduler.swap(cid)
        self.metrics.promotions += 1
        self.ledger.record_event("promoted", {"previous": prev, "name": name, "install_s": r.seconds,
                                              **(evidence or {})}, candidate_id=cid, agent_id=agent_id)
        log.info("promoted", candidate=cid, previous=prev)
        return {"ok": True, "candidate_id": cid, "previous": prev, "install": r.model_dump(mode="json")}

    def rollback(self, to: str = REFERENCE, reason: str = "", agent_id: str = "serve",
                 evidence: dict | None = None) -> dict:
        """Swap back to an installed forward pass (default the reference)."""
        try:
            prev = self.scheduler.swap(to)
        except KeyError as e:
            return {"ok": False, "error": str(e)}
        self.metrics.rollbacks += 1
        self.ledger.record_event("rolled_back", {"to": to, "reason": reason, **(evidence or {})},
                                 candidate_id=prev, agent_id=agent_id)
        log.info("rolled back", candidate=prev, to=to, reason=reason)
        return {"ok": True, "active": to, "previous": prev}

    def encode(self, prompt) -> list[int]:
        """A prompt: text, a list of token ids, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.engine.model.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.engine.model.vocab_size})")
            return list(prompt)
        raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")


def chat_prompt(messages) -> str:
    """OpenAI chat messages -> one prompt text (`role: content` lines, then `assistant: `)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError("each message needs a role and content")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant: "


# ---- HTTP ------------------------------------------------------------------------------------

def _params(body: dict, service: Service) -> dict:
    def num(key, default, typ=float):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RequestError(f"{key} must be a number")
        return typ(v)
    if num("n", 1, int) != 1:
        raise RequestError("only n=1 is supported")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return {"max_tokens": num(key, service.config.default_max_tokens, int),
            "temperature": num("temperature", 1.0), "top_p": num("top_p", 1.0),
            "seed": None if body.get("seed") is None else num("seed", 0, int),
            "ignore_eos": bool(body.get("ignore_eos", False))}


def _error(message: str, status: int = 400, code: str | None = None):
    from starlette.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}}, status_code=status)


def make_app(service: Service):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            model = body.get("model")
            if model is not None and model not in service.model_names:
                service.metrics.request(endpoint, "not_found")
                return _error(f"the model {model!r} does not exist; this server has "
                              f"{service.engine.model.name!r}", 404, "model_not_found")
            prompt = service.encode(chat_prompt(body.get("messages")) if chat else body.get("prompt"))
            req = GenRequest(prompt=prompt, endpoint=endpoint, **_params(body, service))
        except (RequestError, ValueError) as e:
            service.metrics.request(endpoint, "bad_request")
            return _error(str(e))
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def emit(ev):  # called on the scheduler thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass
        req.emit = emit
        try:
            service.scheduler.submit(req)
        except RequestError as e:
            service.metrics.request(endpoint, "bad_request")
            return _error(str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + req.id
        created, name = int(time.time()), service.engine.model.name
        obj = "chat.completion" if chat else "text_completion"
        usage = lambda: {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.out),  # noqa: E731
                         "total_tokens": len(req.prompt) + len(req.out)}

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
                if chat:
                    delta = ({"role": "assistant", "content": ""} if first else
                             {} if delta_text is None else {"content": delta_text})
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
                return "data: " + json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                              "model": name, "choices": [choice]}) + "\n\n"

            async def events():
                done, text, ids = False, "", []
                try:
                    if chat:
                        yield chunk(None, None, first=True)
                    while True:
                        kind, val = await q.get()
                        if kind == "token":
                            ids.append(val)  # req.out may already be ahead: the scheduler does not wait
                            full = service.decode(ids)
                            delta, text = full[len(text):], full
                            yield chunk(delta, None)
                        elif kind == "done":
                            done = True
                            yield chunk(None, val)
                            if include_usage:
                                yield "data: " + json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                                             "created": created, "model": name, "choices": [],
                                                             "usage": usage()}) + "\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            done = True
                            yield "data: " + json.dumps({"error": {"message": val, "type": "server_error"}}) + "\n\n"
                            return
                finally:
                    if not done:
                        service.scheduler.cancel(req)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            while True:
                kind, val = await q.get()
                if kind == "done":
                    break
                if kind == "error":
                    return JSONResponse({"error": {"message": val, "type": "server_error"}}, status_code=500)
        finally:
            if req.finish_reason is None:
                service.scheduler.cancel(req)
        text = service.decode(req.out)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": req.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice],
                             "usage": usage()})

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat(request: Request):
        return await generate(request, chat=True)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": service.engine.model.name, "object": "model", "created": int(service.started),
            "owned_by": "tkcc", "max_model_len": service.engine.state.max_seq, "forward_pass": service.active}]})

    async def health(request: Request):
        running, waiting = service.scheduler.counts()
        return JSONResponse({"ok": True, "model": service.engine.model.name, "device": service.engine.config.device,
                             "active": service.active, "running": running, "waiting": waiting,
                             "requests_logged": service.log.count})

    async def metrics(request: Request):
        running, waiting = service.scheduler.counts()
        return PlainTextResponse(service.metrics.render(service.active, running, waiting),
                                 media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)])


def _bind(host: str, port: int) -> socket.socket:
    check_loopback(host)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


class ServingServer:
    """The HTTP server on a background thread (tests, embedding): `start()`, `url`, `stop()`."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.service = service
        self.sock = _bind(host, port)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(service), log_level="warning", lifespan="off"))
        self.server.capture_signals = contextlib.nullcontext
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name="tkcc-http", daemon=True)

    def start(self) -> "ServingServer":
        self.service.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the serving HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.close()
        self.sock.close()


# ---- command line ----------------------------------------------------------------------------

def add_parser(sub, add_dataclass_args) -> None:
    from engine_server.drift import DriftConfig
    from tkcc_mcp.continual import ContinualConfig
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API on the active forward pass (loopback)",
                       description=__doc__.split("\n\n")[0])
    add_dataclass_args(p, EngineConfig)
    add_dataclass_args(p, ServeConfig)
    add_dataclass_args(p, ContinualConfig)
    add_dataclass_args(p, DriftConfig)
    p.add_argument("--ready-file", default=None, help="write {url, pid, ...} here once listening")


def main(args) -> int:
    import uvicorn

    from engine_server.drift import DriftConfig
    from tkcc_mcp.cli import config_from
    from tkcc_mcp.continual import Continual, ContinualConfig
    ecfg, scfg = config_from(args, EngineConfig), config_from(args, ServeConfig)
    sock = _bind(scfg.host, scfg.port)
    service = Service(ecfg, scfg)
    url = f"http://{'[' + scfg.host + ']' if ':' in scfg.host else scfg.host}:{sock.getsockname()[1]}"
    if scfg.continual:
        service.continual = Continual(service, config_from(args, ContinualConfig), config_from(args, DriftConfig))
    service.start()
    if service.continual is not None:
        service.continual.start()
    info = {"url": url, "pid": __import__("os").getpid(), "model": service.engine.model.name,
            "serving_log": str(service.log.path), "ledger": str(service.ledger.path), "continual": scfg.continual}
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps(info))
    print(f"tkcc serve on {url}/v1 (model {service.engine.model.name}, device {ecfg.device}); "
          f"serving log {service.log.path}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(service), log_level="warning", lifespan="off"))
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        service.close()
    return 0
