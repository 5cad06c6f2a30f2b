"""Installing a candidate forward pass: parse, import into a fresh module, validate the
signature, `prepare` within a memory budget, warm up, capture CUDA graphs, ready.

Every stage's failure is an `ErrorInfo` (stage, error type, message, short traceback), never
an exception out of `install`. A candidate is the text of one Python module defining
`forward(state, batch) -> logits` and optionally `prepare(state)` (see state.py).
"""

from __future__ import annotations

import ast
import gc
import inspect
import linecache
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine_server.results import ErrorInfo

MODULE_PREFIX = "tkcc_candidates."


class StageError(Exception):
    """Raised inside the install pipeline to carry a failure's stage."""

    def __init__(self, stage: str, exc: BaseException):
        super().__init__(str(exc))
        self.stage, self.exc = stage, exc


@dataclass
class Candidate:
    id: str
    source: str
    name: str | None = None
    parent: str | None = None
    module: types.ModuleType | None = None
    forward: Callable | None = None
    scratch: dict[str, Any] = field(default_factory=dict)
    prepare_bytes: int = 0
    graphs: Any = None  # graphs.StepGraphs on CUDA
    stage: str = ""
    error: ErrorInfo | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.stage == "ready"


def load_module(cid: str, source: str) -> types.ModuleType:
    """Parse and execute `source` as a fresh module named tkcc_candidates.<cid>.

    The source is registered with linecache, so tracebacks show the candidate's own lines.
    """
    filename = f"<candidate {cid}>"
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise StageError("parse", e) from None
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    name = MODULE_PREFIX + cid
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # torch.compile and pickling look modules up by name
    try:
        exec(compile(tree, filename, "exec"), module.__dict__)
    except BaseException as e:  # noqa: BLE001 - anything the module does at import is its failure
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise StageError("import", RuntimeError(f"module raised {type(e).__name__} at import")) from None
        raise StageError("import", e) from None
    return module


def validate(module: types.ModuleType) -> Callable:
    """`forward(state, batch)` must exist; `prepare(state)` is optional."""
    fwd = getattr(module, "forward", None)
    if fwd is None or not callable(fwd):
        raise StageError("validate", TypeError("the module defines no callable `forward(state, batch)`"))
    _check_arity(fwd, 2, "forward(state, batch)")
    prep = getattr(module, "prepare", None)
    if prep is not None:
        if not callable(prep):
            raise StageError("validate", TypeError("`prepare` is not callable"))
        _check_arity(prep, 1, "prepare(state)")
    return fwd


def _check_arity(fn: Callable, n: int, want: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some compiled callables have no signature: accept, call will tell
    try:
        sig.bind(*range(n))
    except TypeError as e:
        raise StageError("validate", TypeError(f"signature must be {want}; got {fn.__name__}{sig} ({e})")) from None


def tensor_bytes(obj: Any, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of distinct tensor storages reachable from obj through dicts/lists/attrs."""
    seen = set() if seen is None else seen
    if depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(t, seen, depth + 1) for t in obj.state_dict().values())
    return 0


def run_prepare(cand: Candidate, state, budget_bytes: int, exclude: set[int]) -> None:
    """Run prepare(state) and charge what it allocated against the budget.

    On CUDA the charge is the allocator's growth; on the CPU it is the tensors that
    prepare left in `state.scratch` or the module's globals (the weights excluded).
    """
    prep = getattr(cand.module, "prepare", None)
    if prep is None:
        return
    on_cuda = state.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(state.device)
    try:
        prep(state)
    except BaseException as e:  # noqa: BLE001
        raise StageError("prepare", _plain(e)) from None
    if on_cuda:
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated(state.device) - before
    else:
        seen = set(exclude)
        used = tensor_bytes(cand.scratch, seen) + tensor_bytes(
            {k: v for k, v in vars(cand.module).items() if not k.startswith("__")}, seen)
    cand.prepare_bytes = max(0, used)
    if used > budget_bytes:
        raise StageError("prepare", MemoryError(
            f"prepare allocated {used / 2**20:.1f} MiB, over the budget of {budget_bytes / 2**20:.1f} MiB"))


def _plain(e: BaseException) -> BaseException:
    """SystemExit/KeyboardInterrupt from a candidate are its failures, not ours."""
    if isinstance(e, (SystemExit, KeyboardInterrupt)):
        return RuntimeError(f"candidate raised {type(e).__name__}({e})")
    return e


def unload(cand: Candidate) -> None:
    if cand.graphs is not None:
        cand.graphs.clear()
    sys.modules.pop(MODULE_PREFIX + cand.id, None)
    cand.module = cand.forward = cand.graphs = None
    cand.scratch.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
