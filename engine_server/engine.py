"""The persistent engine: weights, KV cache, traffic and forward passes, loaded once.

`Engine` methods are named like the MCP tools (`read_engine_source`, `submit_forward_pass`,
`measure_fast`, `measure_full`, `check_bit_exact`) plus `rollback`, `leaderboard`,
`candidate_source`, `traffic_profile` and `info`; every one returns a pydantic result.
Candidates are installed in place: never a process restart, never a weight reload. The
reference forward pass of the model's family is itself installed as candidate `reference`.

Usable in-process:

    eng = Engine(EngineConfig(model="llama-3.2-1b", shrink=True))
    r = eng.submit_forward_pass(source)
    eng.check_bit_exact(r.candidate_id); eng.measure_fast(r.candidate_id)
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from pathlib import Path

import torch

from engine_server import candidate as cands
from engine_server import exact, measure, traffic
from engine_server.config import EngineConfig, ModelConfig, check_device, parse_dtype, resolve_model, shrink
from engine_server.graphs import StaticInputs, StepGraphs
from engine_server.guards import IntrospectionGuard, ProcessGuard, StateGuard, WeightGuard
from engine_server.heap import keep_heap
from engine_server.log import get_logger
from engine_server.models import family, source_file
from engine_server.results import ErrorInfo, ExactResult, InstallResult, MeasureResult, hardware
from engine_server.state import State, new_cache
from engine_server.weights import init_weights, load_weights

log = get_logger("engine")

REFERENCE = "reference"


def fast_layers(num_layers: int, fraction: float, least: int = 1) -> tuple[int, ...]:
    """The layers the fast tier runs: `fraction` of them (at least `least`, at least one),
    spread evenly from the first to the last (one: the middle one); all of them at fraction 1."""
    n = min(num_layers, max(1, least, round(num_layers * fraction)))
    if n == 1:
        return (num_layers // 2,) if num_layers > 1 else (0,)
    return tuple(sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)}))


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        t0 = time.perf_counter()
        self.config = cfg = (config or EngineConfig()).resolved()
        check_device(cfg.device)
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)
        # CPU: steady step times (engine_server.heap); False where not asked or not glibc
        self.heap_kept = self.device.type == "cpu" and cfg.cpu_keep_heap and keep_heap()
        self.dtype = parse_dtype(cfg.dtype)
        mcfg, model_dir = resolve_model(cfg.model)
        if cfg.shrink:
            mcfg = shrink(mcfg)
        self.model: ModelConfig = mcfg
        self.model_dir = model_dir
        self.family = family(mcfg)
        max_seq = min(cfg.max_seq, mcfg.max_position_embeddings)
        if model_dir is not None and not cfg.shrink:
            weights = load_weights(model_dir, mcfg, self.dtype, self.device)
            self.weights_source = str(model_dir)
        else:
            weights = init_weights(mcfg, cfg.seed, self.dtype, self.device)
            self.weights_source = f"random init, seed {cfg.seed}"
            if model_dir is not None:  # shrunk: its shapes are not the checkpoint's
                log.warning("shrunk: the directory's weights are not loaded; random init from the seed",
                            model_dir=str(model_dir), seed=cfg.seed)
        self.weights_loaded = 1
        k, v = new_cache(mcfg, cfg.max_batch + 1, max_seq, self.dtype, self.device)
        self.pad_slot = cfg.max_batch  # the last slot: padding rows and warm-up write here
        self.state = State(mcfg, weights, k, v, self.family.tables(mcfg, weights, max_seq, self.dtype, self.device),
                           tuple(range(mcfg.num_layers)))
        self.fast_layers = fast_layers(mcfg.num_layers, cfg.fast_fraction, cfg.fast_min_layers)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.weight_guard = WeightGuard(weights | self.state.tables)  # tables are weights too
        self.state_guard = StateGuard(self.state)
        self.process_guard = ProcessGuard()
        self.sweep_guards = self.process_guard.sweep  # bound now: between rounds and replays (measure, exact)
        self.introspection_guard = IntrospectionGuard()
        self._checks = (self.state_guard.check, self.weight_guard.check, self.process_guard.check,
                        self.introspection_guard.check)
        self.traffic = traffic.TrafficData.build(cfg.traffic, model_dir, mcfg.vocab_size)
        self.cuda = self.device.type == "cuda"
        self.graph_sizes = sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= cfg.max_batch} | {cfg.max_batch})
        self.inputs = StaticInputs(self.graph_sizes, self.device) if self.cuda else None
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.candidates: dict[str, cands.Candidate] = {}
        self.logits_dtype: torch.dtype | None = None  # the reference's, which every pass must return
        self.active = REFERENCE
        self._next = 0
        self._lock = threading.RLock()
        self.fast_setup = measure.FastSetup.build(self)
        self.replay_schedule = None  # built by the first full-tier call
        ref = self._install(REFERENCE, Path(self.family.__file__).read_text(), "reference", None)
        if not ref.ok:
            raise RuntimeError(f"the reference forward pass failed to install: {ref.error}")
        self.startup_s = time.perf_counter() - t0
        log.info("engine ready", model=mcfg.name, device=cfg.device, dtype=cfg.dtype,
                 layers=mcfg.num_layers, fast_layers=list(self.fast_layers), seconds=round(self.startup_s, 2))

    # ---- tools -------------------------------------------------------------------------

    def read_engine_source(self, path: str | None = None, start_line: int | None = None,
                           end_line: int | None = None) -> dict:
        from engine_server import snapshot
        return snapshot.read(snapshot.SNAPSHOT_DIR, path, start_line, end_line, reference=source_file(self.model))

    def submit_forward_pass(self, source: str, name: str | None = None, parent: str | None = None,
                            candidate_id: str | None = None) -> InstallResult:
        with self._lock:
            if candidate_id is None:
                self._next += 1
                candidate_id = f"l{self._next:04d}"
            if candidate_id in self.candidates:
                cands.unload(self.candidates.pop(candidate_id))
            return self._install(candidate_id, source, name, parent)

    def measure_fast(self, candidate_id: str) -> MeasureResult:
        with self._lock:  # the call and what it adds to the reference's depth pool, together
            res = self._run_checked(candidate_id, "fast", measure.fast)
            measure.pool_reference_depth(self.fast_setup, res)
            return res

    def measure_full(self, candidate_id: str) -> MeasureResult:
        return self._run_checked(candidate_id, "full", measure.full)

    def check_bit_exact(self, candidate_id: str, mode: str = "bitwise", factor: float = 2.0,
                        floor: float = 1e-3) -> ExactResult:
        def run(eng, cand):
            return exact.check(eng, cand, mode=mode, factor=factor, floor=floor)
        return self._run_checked(candidate_id, "exact", run)

    def rollback(self, candidate_id: str = REFERENCE) -> dict:
        """Make `candidate_id` (default: the reference) the active forward pass."""
        with self._lock:
            if candidate_id not in self.candidates or not self.candidates[candidate_id].ok:
                return {"ok": False, "active": self.active, "error": f"no installed candidate {candidate_id!r}"}
            self.active = candidate_id
            return {"ok": True, "active": candidate_id}

    def remove(self, candidate_id: str) -> dict:
        """Uninstall a candidate and free its graphs (the reference stays)."""
        with self._lock:
            if candidate_id == REFERENCE or candidate_id not in self.candidates:
                return {"ok": False, "error": f"cannot remove {candidate_id!r}"}
            cands.unload(self.candidates.pop(candidate_id))
            if self.active == candidate_id:
                self.active = REFERENCE
            return {"ok": True}

    def candidate_source(self, candidate_id: str) -> dict:
        c = self.candidates.get(candidate_id)
        if c is None:
            return {"ok": False, "error": f"unknown candidate {candidate_id!r}"}
        return {"ok": True, "candidate_id": candidate_id, "name": c.name, "parent": c.parent, "source": c.source}

    def traffic_profile(self) -> dict:
        return {"source": self.config.traffic, "profile": self.traffic.profile.model_dump(),
                "fast_shapes": [s.name for s in self.fast_setup.shapes],
                "fast_layers": list(self.fast_layers),
                "full_tier": {"requests": self.config.full_requests, "max_prompt": self.config.full_max_prompt,
                              "max_output": self.config.full_max_output, "trace_speed": self.config.trace_speed}}

    def info(self) -> dict:
        return {"model": self.model.to_dict(), "family_source": source_file(self.model),
                "weights": self.weights_source, "weights_loaded": self.weights_loaded,
                "weight_bytes": self.weight_bytes, "config": dataclasses.asdict(self.config),
                "hardware": hardware(str(self.device)).model_dump(), "fast_layers": list(self.fast_layers),
                "candidates": sorted(self.candidates), "active": self.active,
                "startup_s": round(self.startup_s, 3), "memory": self.memory()}

    def memory(self) -> dict:
        if not self.cuda:
            return {"weights_bytes": self.weight_bytes, "heap_kept": self.heap_kept}
        return {"weights_bytes": self.weight_bytes, "allocated": torch.cuda.memory_allocated(self.device),
                "peak_allocated": torch.cuda.max_memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device)}

    # ---- internals ---------------------------------------------------------------------

    def candidate_state(self, cand: cands.Candidate, layers: tuple[int, ...] | None = None) -> State:
        """The State a candidate sees: shared tensors in its own containers (weights, tables,
        cache lists: what it does to them stays in its view), its own scratch."""
        st = self.state
        return dataclasses.replace(st, weights=dict(st.weights), tables=dict(st.tables), k_cache=list(st.k_cache),
                                   v_cache=list(st.v_cache), scratch=cand.scratch,
                                   layers=st.layers if layers is None else tuple(layers))

    def _guards(self) -> list[str]:
        """Every guard's violations since the last look (each puts back what it found changed).
        The checks were bound at start-up: one a pass replaced on its class still runs as built,
        and the process guard reports the replacement."""
        return [v for check in self._checks for v in check()]

    def _install(self, cid: str, source: str, name: str | None, parent: str | None) -> InstallResult:
        t0 = time.perf_counter()
        cand = cands.Candidate(cid, source, name, parent)
        snap = self.state.clone_cache()
        try:
            with deadline(self.config.call_timeout_s):
                cand.module = cands.load_module(cid, source)
                cand.stage = "imported"
                cand.forward = cands.validate(cand.module)
                cand.stage = "validated"
                budget = int(self.config.prepare_budget_mb * 2**20) or self.weight_bytes + 256 * 2**20
                st = self.candidate_state(cand)
                cands.run_prepare(cand, st, budget, exclude=self._weight_storages())
                cand.stage = "prepared"
                self._warmup(cand)
                cand.stage = "warmed"
                if self.cuda and self.config.capture_graphs:
                    self._capture(cand)
                    cand.stage = "captured"
                cand.stage = "ready"
        except cands.StageError as e:
            cand.error = ErrorInfo.from_exc(e.stage, e.exc)
        except TimeoutError as e:
            cand.error = ErrorInfo.from_exc("timeout", e)
        except BaseException as e:  # noqa: BLE001 - a candidate's failure is a result
            cand.error = ErrorInfo.from_exc(_stage_after(cand.stage), cands._plain(e))
        finally:
            self.state.load_cache(*snap)
        violations = self._guards()
        if violations and cand.error is None:
            cand.error = ErrorInfo(stage="install", type="Violation", message="; ".join(violations))
        elif violations:  # the failure it caused, and what the guards saw
            cand.error.message += f" (violations: {'; '.join(violations)})"
        if cand.ok:
            self.candidates[cid] = cand
        else:
            cands.unload(cand)
        res = InstallResult(candidate_id=cid, name=name, parent=parent, ok=cand.ok,
                            stage=cand.stage or "none", error=cand.error, prepare_bytes=cand.prepare_bytes,
                            graphs=cand.graphs.names() if cand.graphs else [], notes=cand.notes,
                            seconds=round(time.perf_counter() - t0, 4))
        log.info("install", candidate=cid, ok=res.ok, stage=res.stage,
                 error=res.error.type if res.error else None, seconds=res.seconds)
        return res

    def _weight_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.state.weights.values()}

    def _warmup(self, cand: cands.Candidate) -> None:
        """Prefill and decode once on the padding slot: every path runs before capture."""
        st = self.candidate_state(cand)
        from engine_server.state import decode_batch, prefill_batch
        pad = torch.tensor([self.pad_slot], device=self.device)
        toks = torch.tensor([self.traffic.tokens(4, 0)], device=self.device)
        try:
            for b in (prefill_batch(toks, pad), decode_batch(toks[:, -1], torch.tensor([4], device=self.device), pad)):
                out = measure.check_logits(cand.forward(st, b), b, self.model.vocab_size, self.logits_dtype,
                                           self.device)
                self.logits_dtype = self.logits_dtype or out.dtype  # the reference's, installed first
        except cands.StageError:
            raise
        except BaseException as e:  # noqa: BLE001
            raise cands.StageError("warmup", cands._plain(e)) from None

    def _capture(self, cand: cands.Candidate) -> None:
        graphs = StepGraphs(cand.forward, self.inputs, self.pool)
        sizes = {(self.state.layers, b) for b in self.graph_sizes}
        decode = [s.size for s in self.fast_setup.shapes if not s.prefill]
        sizes |= {(layers, b) for layers in (self.fast_layers, ()) for b in decode}
        for b, static in self.inputs.batches.items():  # padding-slot inputs: captures write there only
            static.slots.fill_(self.pad_slot)
            static.positions.fill_(1)
            static.tokens.fill_(0)
        try:
            for layers, b in sorted(sizes, key=lambda x: (len(x[0]), x[1])):
                graphs.capture(self.candidate_state(cand, layers), b)
        except BaseException as e:  # noqa: BLE001 - not capturable: it runs eagerly, and says so
            graphs.clear()
            torch.cuda.synchronize()
            self._fresh_pool()
            cand.notes.append(f"not capturable in a CUDA graph, runs eagerly: {type(e).__name__}: "
                              f"{str(e)[:300]}")
            return
        cand.graphs = graphs

    def _fresh_pool(self) -> None:
        """After a failed capture: the allocator may still be recording into the graph pool
        (a capture that raised in its end keeps its pool id registered), and the next
        capture into that id would fail. End that recording and use a new pool from here on;
        graphs already captured keep the old one alive."""
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(self.device.index or torch.cuda.current_device(), self.pool)
        self.pool = torch.cuda.graph_pool_handle()

    def _run_checked(self, candidate_id: str, what: str, fn):
        """Run a measurement or check with the guards around it; failures become results."""
        model = ExactResult if what == "exact" else MeasureResult
        extra = {} if what == "exact" else {"tier": what, "valid": False}
        with self._lock:
            cand = self.candidates.get(candidate_id)
            if cand is None:
                return model(candidate_id=candidate_id, ok=False, **extra, error=ErrorInfo(
                    stage="lookup", type="KeyError",
                    message=f"no installed candidate {candidate_id!r}; installed: {sorted(self.candidates)}"))
            t0 = time.perf_counter()
            snap = self.state.clone_cache() if what == "exact" else None
            try:
                with deadline(self.config.call_timeout_s):
                    res = fn(self, cand)
            except TimeoutError as e:
                res = model(candidate_id=candidate_id, ok=False, **extra, error=ErrorInfo.from_exc("timeout", e))
            except measure.CandidateFailure as e:
                res = model(candidate_id=candidate_id, ok=False, **extra, error=ErrorInfo.from_exc("forward", e.exc))
            finally:
                if snap is not None:
                    self.state.load_cache(*snap)
            t_guards = time.perf_counter()
            violations = self._guards()
            if isinstance(res, MeasureResult) and "phases_s" in res.config:
                res.config["phases_s"]["guards"] = round(time.perf_counter() - t_guards, 4)
            if violations:
                res.violations = list(res.violations) + violations
                if isinstance(res, ExactResult):
                    res.exact = False
                else:
                    res.valid = False
            res.seconds = round(time.perf_counter() - t0, 4)
            res.hardware = hardware(str(self.device))
            log.info(what, candidate=candidate_id, ok=res.ok,
                     speedup=getattr(res, "speedup", None), exact=getattr(res, "exact", None),
                     violations=len(res.violations), seconds=res.seconds)
            return res


def _stage_after(stage: str) -> str:
    return {"": "import", "imported": "validate", "validated": "prepare", "prepared": "warmup",
            "warmed": "capture"}.get(stage, "install")


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in the calling (main) thread after `seconds`. Interrupts Python-level
    hangs only; a hang inside a kernel or C call is the server's to end, by killing the worker."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"call exceeded its timeout of {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
