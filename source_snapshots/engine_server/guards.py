"""Anti-cheat checks: the verdicts must hold against a candidate that tampers with the
process it runs in. Each check returns a list of violations (plain sentences); empty = clean.

What is caught, and where (tests/cheaters/ holds one candidate of each kind):
- writing to the weights: `WeightGuard` (a pristine copy, tensor identity and version
  counters), after prepare and after every guarded run;
- swapping what the engine's `State` holds (a table, a cache layer, the layers to run) by
  reaching past the candidate's own view of it: `StateGuard`, at the same points;
- results kept from an earlier call: `exact.py`'s probe re-runs a step on a changed cache
  and the output must change as the reference's does;
- skipping layers: bitwise logits over all layers and over the fast tier's subset
  (`exact.py`), and the timed outputs compared with the reference's (`measure.py`);
- K/V written outside the batch's cells: the whole cache compared with the reference's
  after the same steps (`exact.py`);
- work left unsynchronised on a side stream or thread: `settled()` reads the output in
  stream order as `forward` returns and again after a full device sync and after joining
  the threads the call started;
- patching the engine (timers, checks, torch entry points, the engine's own methods), or
  what the reference runs on (every name it looks up in torch and the model modules, torch's
  process-wide settings), or leaving a thread running candidate code between its calls:
  `ProcessGuard` snapshots them at start, sweeps between turns, and restores (stops) and
  reports any that changed;
- reaching into the engine's frames and objects (frames, gc's object lists, tracing, ctypes)
  from candidate code: `IntrospectionGuard`, an audit hook that refuses the call and reports it.
"""

from __future__ import annotations

import operator
import sys
import threading
import time
from typing import Callable

import torch


class WeightGuard:
    """Keeps a pristine copy of the weights, out of the candidates' reach by convention only:
    the copy lives in this object, not in State."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.ids = {k: (id(t), t.data_ptr()) for k, t in weights.items()}
        self.copy = {k: t.detach().clone() for k, t in weights.items()}
        self.versions = {k: t._version for k, t in weights.items()}

    def check(self, weights: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Compare the engine's weights (and, if given, the dict a candidate saw) with the copy.
        Restores any tensor it finds changed, so the next candidate starts clean."""
        out = []
        if weights is not None and set(weights) != set(self.copy):
            out.append("changed the set of weight tensors in state.weights")
        for k, ref in self.copy.items():
            t = self.weights[k]
            if (id(t), t.data_ptr()) != self.ids[k] or (weights is not None and k in weights
                                                       and weights[k] is not t):
                out.append(f"replaced weight tensor {k}")
            elif t._version != self.versions[k] or not torch.equal(t, ref):
                out.append(f"wrote to weight {k}")
                t.copy_(ref)
                self.versions[k] = t._version
        return out


class StateGuard:
    """The engine's `State` as built: each field's object and, for the weights, tables and
    caches, the tensor each name or layer holds. Candidates see copies of these containers
    (`Engine.candidate_state`); one that reaches the engine's own and swaps an entry (a table
    changed for every later call, reference included; a cache layer that CUDA graphs captured
    earlier no longer read) is reported and put back."""

    CONTAINERS = ("weights", "tables", "k_cache", "v_cache")

    def __init__(self, state):
        import dataclasses
        self.state = state
        self.fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "scratch"}
        self.items = {f: (dict if isinstance(self.fields[f], dict) else list)(self.fields[f]) for f in self.CONTAINERS}

    def check(self) -> list[str]:
        out = []
        for name, obj in self.fields.items():
            if getattr(self.state, name) is not obj:
                out.append(f"replaced the engine's state.{name}")
                setattr(self.state, name, obj)
        for name, items in self.items.items():
            now = self.fields[name]
            if isinstance(items, dict):
                keys = set(items) | set(now)
                changed = sorted(k for k in keys if now.get(k) is not items.get(k))
                if changed:
                    out.append(f"swapped the engine's state.{name} entries {changed[:5]}")
                    now.clear()
                    now.update(items)
            elif len(now) != len(items) or any(a is not b for a, b in zip(now, items)):
                out.append(f"swapped the engine's state.{name} layers (the KV cache list)")
                now[:] = items
        return out


# what a pass could reach the engine's own frames and objects with: its measurement's locals (the
# rounds' ratios, a reply being written), the State, the guards. Refused when the code asking is a
# candidate's (its own frame, or the one below it: inspect.currentframe() and the like)
INTROSPECTION = frozenset({"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
                           "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
_refused: list[str] = []
_audit = threading.local()


def _audit_hook(event: str, args: tuple) -> None:
    if not (event in INTROSPECTION or event.startswith("ctypes.")
            or (event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRS)):
        return
    if getattr(_audit, "busy", False):  # the frames looked at below raise events of their own
        return
    _audit.busy = True
    try:
        f = sys._getframe(1)
        for _ in range(2):
            if f is None:
                return
            if f.f_code.co_filename.startswith("<candidate "):
                what = f"{event}{f' ({args[1]})' if event == 'object.__getattr__' else ''}"
                _refused.append(f"inspected the engine's process: {what} at {f.f_code.co_filename[1:-1]} "
                                f"line {f.f_lineno}")
                raise RuntimeError(f"candidates may not inspect the engine's process ({what})")
            f = f.f_back
    finally:
        _audit.busy = False


class IntrospectionGuard:
    """Refuses a pass the means to reach into the engine's process (frames, the garbage
    collector's object lists, tracing, ctypes) with a Python audit hook, installed once a
    process and never removable: the call raises in the candidate, and the next check reports
    it. What it cannot see is listed in the README's trust model."""

    _hooked = False

    def __init__(self):
        if not IntrospectionGuard._hooked:
            sys.addaudithook(_audit_hook)
            IntrospectionGuard._hooked = True

    def check(self) -> list[str]:
        out = list(dict.fromkeys(_refused))
        _refused.clear()
        if getattr(_audit, "busy", False):  # left set by a pass, the hook would let it through
            _audit.busy = False
            out.append("tampered with the engine: switched off its introspection guard")
        return out


def settled(run: Callable[[], torch.Tensor], wait_s: float = 0.05) -> tuple[torch.Tensor, list[str]]:
    """Run a forward pass and check its output is final when it returns.

    The first copy is taken in stream order right after the call (what a caller that trusts
    the stream sees); the second after synchronising the device (every stream) and joining
    the threads the call started (up to wait_s in all), so work left running on another
    stream or thread has landed. They must be equal. Work handed to a thread that existed
    before the call is not waited for: it shows as a first copy that differs from the
    reference's output (the callers compare the two).
    """
    before = set(threading.enumerate())
    out = run()
    first = out.detach().clone()  # ordered on the current stream
    if out.is_cuda:
        torch.cuda.synchronize()
    until = time.perf_counter() + wait_s
    for t in set(threading.enumerate()) - before:
        t.join(max(0.0, until - time.perf_counter()))
    if out.is_cuda:
        torch.cuda.synchronize()
    if not torch.equal(first, out) and not (first.isnan().any() and torch.equal(first.isnan(), out.isnan())):
        return first, ["left work unsynchronised: the output changed after forward returned "
                       "(a side stream or thread the caller cannot see)"]
    return first, []


def _attr(obj, name: str) -> tuple[Callable, Callable]:
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


def _settings() -> dict[str, tuple[Callable, Callable]]:
    """torch's process-wide settings that change what the reference computes or how fast it
    runs (TF32 or reduced-precision reductions, SDPA's kernels, cuDNN's autotuner, threads,
    the default dtype): name -> (get, set). A pass may change one inside its own call; one it
    leaves changed changes the reference's side too."""
    b = torch.backends
    out = {f"torch.backends.cuda.matmul.{n}": _attr(b.cuda.matmul, n)
           for n in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")}
    out |= {f"torch.backends.cudnn.{n}": _attr(b.cudnn, n) for n in ("enabled", "allow_tf32", "benchmark", "deterministic")}
    out["torch.backends.mkldnn.enabled"] = _attr(b.mkldnn, "enabled")
    for n in ("flash", "mem_efficient", "math", "cudnn"):
        if hasattr(b.cuda, f"{n}_sdp_enabled"):
            out[f"torch.backends.cuda.{n}_sdp_enabled"] = (getattr(b.cuda, f"{n}_sdp_enabled"),
                                                           getattr(b.cuda, f"enable_{n}_sdp"))
    out |= {"torch.get_float32_matmul_precision": (torch.get_float32_matmul_precision,
                                                   torch.set_float32_matmul_precision),
            "torch.are_deterministic_algorithms_enabled": (torch.are_deterministic_algorithms_enabled,
                                                           torch.use_deterministic_algorithms),
            "torch.get_num_threads": (torch.get_num_threads, torch.set_num_threads),
            "torch.get_default_dtype": (torch.get_default_dtype, torch.set_default_dtype)}
    return out


def _namespaces() -> list[tuple[str, object]]:
    """What the reference's forward passes look up as they run: torch's functions and tensor
    methods, and the engine's model code and state. A pass that binds the original and then
    replaces a name here (a slowed `F.linear`, a `len` shadowed in a model module) slows or
    changes the reference's side and not its own."""
    import builtins
    import importlib
    import pkgutil

    import torch.nn.functional as F

    import engine_server.models as models
    import engine_server.state as state
    out = [("builtins", builtins), ("torch", torch), ("torch.nn.functional", F), ("torch.linalg", torch.linalg),
           ("torch.special", torch.special), ("torch.Tensor", torch.Tensor),
           ("torch._C.TensorBase", torch._C.TensorBase), ("engine_server.state", state)]
    for m in pkgutil.iter_modules(models.__path__):
        out.append((f"engine_server.models.{m.name}", importlib.import_module(f"engine_server.models.{m.name}")))
    return out


# names a library may rebind on import, which no forward pass calls: torch._dynamo wraps
# torch.manual_seed when it loads (a candidate or a baseline that calls torch.compile)
REBOUND_ON_IMPORT = frozenset({("torch", "manual_seed")})
_SKIP = frozenset({"__dict__", "__weakref__", "__doc__"})


def _library(label: str) -> bool:
    """A library's namespace (torch's, builtins): its dunders are its own business, and a
    name added to builtins shadows nothing (a module's globals come first)."""
    return label == "builtins" or label.split(".")[0] == "torch"


def _watched(label: str, name: str) -> bool:
    """Whether `name` of the namespace `label` is one the guard snapshots and compares."""
    return (name not in _SKIP and not (_library(label) and name.startswith("__"))
            and (label, name) not in REBOUND_ON_IMPORT)


class ProcessGuard:
    """Snapshot of the process entry points that measurement and checks rely on, of every name
    the reference's forward passes look up (`_namespaces`) and of torch's process-wide
    settings (`_settings`), and of threads running a candidate's code between its calls
    (`stray_threads`). `sweep` (cheap: an identity comparison a name while nothing changed)
    runs after the fast tier's candidate turns, the full tier's replays and the candidate's
    side of the exactness check, so a pass that puts things back before a call ends is still
    seen; `check` runs after every call. Each puts back what it found changed (a stray thread:
    stops it) and reports it."""

    def __init__(self, extra: list[tuple[object, str]] | None = None):
        import builtins
        import gc

        import json

        import engine_server.candidate as candidate
        import engine_server.exact as exact
        import engine_server.measure as measure
        from engine_server.engine import Engine

        targets = [(time, "perf_counter"), (time, "perf_counter_ns"), (time, "monotonic"), (time, "sleep"),
                   (torch.cuda, "synchronize"), (torch.cuda, "Event"), (torch.cuda.CUDAGraph, "replay"),
                   (builtins, "compile"), (gc, "collect"), (json, "dumps"),
                   (WeightGuard, "check"), (StateGuard, "check"), (ProcessGuard, "check"), (ProcessGuard, "sweep"),
                   (IntrospectionGuard, "check"), (sys.modules[__name__], "_audit_hook"),
                   (sys.modules[__name__], "stray_threads")]
        # (torch's own names, torch.equal and Tensor.clone among them, are in `_namespaces`)
        # the engine's own methods and what measures and checks (the worker answers with them)
        for mod in (exact, measure, candidate, Engine):
            targets += [(mod, n) for n, v in vars(mod).items() if callable(v) and not n.startswith("__")]
        targets += list(extra or [])
        self.saved = [(obj, name, getattr(obj, name)) for obj, name in targets if hasattr(obj, name)]
        self.spaces = [(label, obj, {k: v for k, v in vars(obj).items() if _watched(label, k)})
                       for label, obj in _namespaces()]
        self._fast = [self._key(obj) for _, obj, _ in self.spaces]
        self.settings = _settings()
        self.settings_saved = {n: get() for n, (get, _) in self.settings.items()}
        self.found: list[str] = []  # what sweeps found since the last check

    @staticmethod
    def _key(obj) -> tuple[tuple, tuple]:
        """A namespace's names and values as they are now (held, so no id is reused)."""
        d = vars(obj)
        return tuple(d), tuple(d.values())

    @staticmethod
    def _same(obj, key: tuple[tuple, tuple]) -> bool:
        """Whether `obj`'s namespace holds the very names and objects of `key`: by identity,
        which a replacement cannot fake as it can equality."""
        d, (names, values) = vars(obj), key
        return len(d) == len(names) and all(map(operator.is_, d.values(), values)) and all(map(operator.is_, d, names))

    def sweep(self) -> None:
        """Put back any watched name or setting changed since the last look, remembering what
        was found for the next `check`."""
        for n, (get, put) in self.settings.items():
            if (now := get()) != (was := self.settings_saved[n]):
                self.found.append(f"changed a torch setting for good: {n} {was} -> {now} (put back)")
                put(was)
        for i, (label, obj, saved) in enumerate(self.spaces):
            if self._same(obj, self._fast[i]):
                continue
            d = vars(obj)
            for k, v in saved.items():
                if d.get(k, _SKIP) is not v:
                    self.found.append(f"tampered with the engine: {label}.{k} was replaced")
                    _put(obj, k, v)
            for k in [k for k in d if k not in saved and _watched(label, k) and label != "builtins"]:
                if isinstance(d[k], type(sys)):  # a submodule imported since: it joins the snapshot
                    saved[k] = d[k]
                    continue
                self.found.append(f"tampered with the engine: {label}.{k} was added")
                _put(obj, k, None, remove=True)
            self._fast[i] = self._key(obj)
        self.found += stray_threads()

    def check(self) -> list[str]:
        out = []
        for obj, name, orig in self.saved:
            if getattr(obj, name, None) is not orig:
                owner = getattr(obj, "__name__", type(obj).__name__)
                out.append(f"tampered with the engine: {owner}.{name} was replaced")
                setattr(obj, name, orig)
        ProcessGuard.sweep(self)
        out += self.found
        self.found = []
        return list(dict.fromkeys(out))


def _running_candidate_code(me: int) -> dict[int, object]:
    """Thread id -> the innermost frame of a candidate's code on its stack, for every thread
    but `me` that has one."""
    out = {}
    for ident, f in sys._current_frames().items():
        while f is not None and not f.f_code.co_filename.startswith("<candidate "):
            f = f.f_back
        if ident != me and f is not None:
            out[ident] = f
    return out


def stray_threads(grace_s: float = 0.05) -> list[str]:
    """Threads other than the caller's that are running a candidate's code (a frame of it
    anywhere on their stack) while no call of it is: one started at import or left behind by
    a call can compete with the reference's turn for the interpreter (a spinning thread held
    the GIL against the reference and made it look 200x slower) or change what it reads. A
    thread that ends within `grace_s` (work a call handed off and that lands: `settled` judges
    that) is not reported; each one still running is stopped (SystemExit raised in it, at its
    next Python instruction) and reported."""
    import ctypes

    me = threading.get_ident()
    found = _running_candidate_code(me)
    if not found:
        return []
    until = time.perf_counter() + grace_s
    for t in threading.enumerate():
        if t.ident in found:
            t.join(max(0.0, until - time.perf_counter()))
    time.sleep(max(0.0, until - time.perf_counter()))  # threads not started through `threading`
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, f in _running_candidate_code(me).items():
        where = f"{f.f_code.co_filename[1:-1]} line {f.f_lineno}"
        out.append(f"left a thread running its code: {names.get(ident, ident)} at {where} (stopped)")
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(SystemExit))
    return out


def _put(obj, name: str, value, remove: bool = False) -> None:
    """Set (or remove) a watched name on a module or class; a C type may refuse (nothing a
    candidate could have set there, then)."""
    try:
        if remove:
            delattr(obj, name)
        else:
            setattr(obj, name, value)
    except (AttributeError, TypeError):
        pass