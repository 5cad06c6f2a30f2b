"""Batch-1 decode of candidate forward passes against the reference and two baselines, in one run.

    python benchmarks/forward_bench.py --device cuda --winners-dir WINNERS examples/candidates/*.py

One process, one GPU:
1. starts an in-process engine (`Engine(EngineConfig(...))`) and times the reference's
   batch-1 greedy decode at `--context`, each step one CUDA graph of the forward, the argmax
   fed back as the next token and the position advanced (as the compiled baseline captures
   its argmax), plus the bare replay of the engine's own forward graph at that context;
2. runs the two baselines of `benchmarks/baselines.py` on the engine's weights and prompt:
   a gpt-fast-style decoder under `torch.compile(mode="reduce-overhead")`, and Hugging Face
   transformers `generate`;
3. hill-climbs through the engine's own tools: for each file that defines a module-level
   `KNOBS = {...}` literal, one knob at a time is doubled or halved (ints that are powers of
   two; other ints +-1; bools flipped; a step that neither wins nor loses is followed by one
   more in the same direction; with `--tilings`, first each projection's fastest tilings
   alone from a `stream_bench.py` JSON, one group's tiling a move) by rewriting that literal
   in the source, submitted
   with `submit_forward_pass(parent=...)` and measured with `measure_fast`; a move is kept
   only when its batch-1 decode speedup over the reference (geometric mean of the fast
   tier's batch-1 decode shapes, measured twice) beats the current best by `--min-gain`
   AND it passes the gate at least as strictly as its parent (bitwise, else the engine's
   tolerance gate: no further from a float32 run of the reference than twice the reference
   itself, identical greedy tokens; `engine_server/exact.py`). Files without KNOBS are
   measured as they are. Within `--budget-s` (and what `--total-s` leaves);
4. re-installs each file's best source alone and reports: both exactness checks (bitwise
   and tolerance), `measure_fast`, `measure_full`, batch-1 decode tok/s at `--context`,
   peak GPU memory of the engine with it installed, and what its `prepare` allocated;
   writes the source and results to `--winners-dir`.

Prints a card (ratios to the reference, to torch.compile and to HF from this one run), then
one JSON line. A failing candidate or baseline is a row with its error, never a crash.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import tokenize
import traceback
from pathlib import Path

import torch

os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")  # the engine's per-call log lines stay out of the card
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import baselines  # noqa: E402
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.engine import REFERENCE, Engine, EngineConfig  # noqa: E402
from engine_server.greedy import argmax  # noqa: E402
from engine_server.graphs import capture  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.state import decode_batch, prefill_batch  # noqa: E402

GATES = {2: "bitwise", 1: "tolerance", 0: "fail"}
GATE_TEXT = {"bitwise": "bitwise: torch.equal on every logit, the greedy tokens and the KV cache",
             "tolerance": "tolerance: on every step the logits are no further from the reference run in float32 "
                          "than 2x the bf16 reference's own distance (+1e-3 of the largest logit), identical "
                          "greedy tokens (K/V inside its own cells may differ by rounding; no other violation)",
             "fail": "fails both gates"}
CUDA_BROKEN = re.compile(r"illegal memory access|device-side assert|CUDA error: (?!out of memory)|"
                         r"unspecified launch failure|misaligned address", re.I)


def log(msg: str) -> None:
    print(msg, flush=True)


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:800]}"


# ---- KNOBS: read and rewrite the literal ----------------------------------------------

def find_knobs(source: str) -> tuple[dict, tuple[int, int]] | None:
    """The module-level `KNOBS = {...}` literal and its byte span in the UTF-8 source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        if any(isinstance(t, ast.Name) and t.id == "KNOBS" for t in targets) and isinstance(node.value, ast.Dict):
            try:
                knobs = ast.literal_eval(node.value)
            except ValueError:
                return None
            if not isinstance(knobs, dict):
                return None
            data = source.encode()
            starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A]
            v = node.value
            return knobs, (starts[v.lineno - 1] + v.col_offset, starts[v.end_lineno - 1] + v.end_col_offset)
    return None


def merged(knobs: dict, override: dict) -> dict:
    """`knobs` with `override`'s values put in, nested dicts merged key by key."""
    out = dict(knobs)
    for k, v in override.items():
        out[k] = merged(knobs[k], v) if isinstance(v, dict) and isinstance(knobs.get(k), dict) else v
    return out


def unknown_knobs(source: str, override: dict) -> list[str]:
    """The knobs in `override` that the file cannot read: neither in its KNOBS literal nor a
    string literal of its code outside that literal (as an optional knob such as "maxnreg" is,
    read with a default). A misspelt or renamed knob is one: merged in, it would make a copy
    that nothing reads and that measures as the file itself."""
    found = find_knobs(source)
    if not found:
        return []
    knobs, span = found
    data = source.encode()
    names = _strings(source, (len(data[:span[0]].decode()), len(data[:span[1]].decode())))

    def walk(have: dict, over: dict, where: str) -> list[str]:
        out = []
        for k, v in over.items():
            if k not in have and k not in names:
                out.append(f"KNOBS{where}[{k!r}]")
            elif isinstance(v, dict) and isinstance(have.get(k), dict):
                out += walk(have[k], v, f"{where}[{k!r}]")
        return out
    return walk(knobs, override, "")


def _strings(source: str, skip: tuple[int, int]) -> set[str]:
    """The string literals of `source` (its comments aside) outside the character span `skip`."""
    starts = [0]
    for line in source.split("\n"):  # as io.StringIO's readline splits it for tokenize
        starts.append(starts[-1] + len(line) + 1)
    out = set()
    try:
        for t in tokenize.generate_tokens(io.StringIO(source).readline):
            at = starts[t.start[0] - 1] + t.start[1]
            if t.type == tokenize.STRING and not skip[0] <= at < skip[1]:
                try:
                    v = ast.literal_eval(t.string)
                except (ValueError, SyntaxError):
                    continue
                if isinstance(v, str):
                    out.add(v)
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def override_knobs(source: str, override: dict, what: str = "the source") -> str:
    """`source` with `override` merged into its KNOBS literal; ValueError when the source has
    no KNOBS or `override` names a knob it cannot read (`unknown_knobs`)."""
    found = find_knobs(source)
    if not found:
        raise ValueError(f"{what} has no KNOBS literal to vary")
    if bad := unknown_knobs(source, override):
        raise ValueError(f"{what} has no {', '.join(bad)} (a misspelt or renamed knob?)")
    return rewrite_knobs(source, found[1], merged(found[0], override))


def climbed(a: argparse.Namespace, f: Path) -> bool:
    """Whether `--climb` names the file's stem (every file when it names none)."""
    only = {s for s in a.climb.split(",") if s}
    return not only or f.stem in only


def check_overrides(a: argparse.Namespace) -> str | None:
    """Why `--variants` or `--start-knobs` cannot apply to the files (not JSON objects, a file
    without KNOBS, a knob a file cannot read), before any engine time is spent; None if they can."""
    for flag, text, files in (("--variants", a.variants, a.files[:1]),
                              ("--start-knobs", a.start_knobs, [f for f in a.files if climbed(a, Path(f))])):
        if not text:
            continue
        try:
            over = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{flag} is not JSON: {e}"
        if not isinstance(over, dict) or (flag == "--variants" and not all(isinstance(v, dict)
                                                                         for v in over.values())):
            return f"{flag} must be a JSON object" + (" of name -> KNOBS overrides" if flag == "--variants" else "")
        for f in files:
            src = _read(Path(f), "")
            if flag == "--start-knobs" and not find_knobs(src):
                continue  # measured as it is, not climbed
            for o in (over.values() if flag == "--variants" else [over]):
                try:
                    override_knobs(src, o, f)
                except ValueError as e:
                    return f"{flag}: {e}"
    return None


def write_variants(path: Path, variants: dict, folder: Path) -> list[Path]:
    """Copies of the candidate at `path`, one per name in `variants`, with that entry's KNOBS
    overrides merged in: `folder`/<stem>-<name>.py."""
    src = _read(path)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, override in variants.items():
        f = folder / f"{path.stem}-{name}.py"
        f.write_text(override_knobs(src, override, str(path)))
        out.append(f)
    return out


def rewrite_knobs(source: str, span: tuple[int, int], knobs: dict) -> str:
    data = source.encode()
    return (data[:span[0]] + repr(knobs).encode() + data[span[1]:]).decode()


def leaves(knobs: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, value) of every tunable leaf; nested dicts are walked."""
    out = []
    for k, v in knobs.items():
        if isinstance(v, dict):
            out += leaves(v, prefix + (k,))
        elif neighbours(v):
            out.append((prefix + (k,), v))
    return out


def with_value(knobs: dict, path: tuple, value) -> dict:
    new = dict(knobs)
    if len(path) == 1:
        new[path[0]] = value
    else:
        new[path[0]] = with_value(knobs[path[0]], path[1:], value)
    return new


def is_candidate(source: str) -> bool:
    """Defines `forward` at module level (a file that does not parse is a candidate: its row says why)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "forward":
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.ImportFrom)):
            names = ([t for t in node.targets] if isinstance(node, ast.Assign) else
                     [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "forward" for t in names):
                return True
            if isinstance(node, ast.ImportFrom) and any((al.asname or al.name) == "forward" for al in node.names):
                return True
    return False


def _get(knobs: dict, path: tuple):
    for k in path:
        knobs = knobs[k]
    return knobs


def neighbours(v) -> list:
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        if v <= 0:
            return [1]
        if v & (v - 1) == 0:
            return [x for x in (v * 2, v // 2) if 1 <= x <= 8192]
        return [x for x in (v + 1, v - 1) if x >= 1]
    return []


def beyond(v, nb):
    """The value one step past `nb` (a neighbour of `v`) in the same direction, or None: where
    the climb looks when a step lands on a plateau (a launch option whose first doubling gains
    nothing may gain at the second)."""
    if isinstance(v, bool) or not isinstance(v, int) or nb == v:
        return None
    if v > 0 and v & (v - 1) == 0:
        far = nb * 2 if nb > v else nb // 2
        return far if 1 <= far <= 8192 and far != nb else None
    far = nb + (nb - v)
    return far if far >= 1 else None


def tiling_seeds(path: str, per_group: int) -> list[tuple[str, dict]]:
    """The `per_group` fastest tilings of each projection in a `stream_bench.py` JSON that passed
    its check (the file's own left out), fastest first: (KNOBS group, its knobs)."""
    seeds = []
    for shape in json.loads(Path(path).read_text())["results"]:
        rows = sorted((r for r in shape["rows"] if r.get("ok") and not r.get("own") and r.get("knobs")),
                      key=lambda r: r["us"])
        seeds += [(shape["shape"], r["knobs"]) for r in rows[:per_group]]
    return seeds


# ---- measurements through the engine ---------------------------------------------------

def climb_time(budget_left: float, total_left: float, files_left: int) -> tuple[float, str | None]:
    """Seconds for the next file's climb: its even share of what both `--budget-s` (budget_left)
    and `--total-s` leave (total_left, after the evaluations still to come). When a budget is
    left but the total leaves nothing, 0 s and why, so that a run never climbs for 0 s unsaid."""
    share = max(0.0, min(budget_left, total_left) / max(files_left, 1))
    if share > 0 or budget_left <= 0:
        return share, None
    return 0.0, (f"not climbed: --total-s leaves no time after the evaluations; "
                 f"{budget_left - total_left:.0f} s more of --total-s would give the climb its --budget-s")


def objective(m) -> float:
    """Batch-1 decode speedup over the reference in one fast-tier call (geometric mean of its
    batch-1 decode shapes); the tier's overall speedup if it has none."""
    ones = [s.speedup for s in m.shapes if s.batch == 1 and s.shape.startswith("decode") and s.speedup > 0]
    if not ones:
        return m.speedup
    return math.exp(statistics.mean(math.log(x) for x in ones))


def gate(eng: Engine, cid: str, need: int = 0, both: bool = False) -> dict:
    """Bitwise check, then (if not bitwise, or `both`) the tolerance check. `need`: skip the
    tolerance check when only bitwise would do."""
    ex = eng.check_bit_exact(cid)
    out = {"bitwise": _exact_dict(ex)}
    level = 2 if ex.exact else 0
    if both or (not ex.exact and need <= 1):
        tol = eng.check_bit_exact(cid, mode="tolerance")
        out["tolerance"] = _exact_dict(tol)
        if level == 0 and tol.ok and tol.close:
            level = 1
    out["level"], out["gate"] = level, GATES[level]
    return out


def _exact_dict(r) -> dict:
    return {"ok": r.ok, "exact": r.exact, "close": r.close, "tokens_equal": r.tokens_equal, "kv_equal": r.kv_equal,
            "max_abs_diff": r.max_abs_diff, "candidate_error": r.candidate_error,
            "reference_error": r.reference_error, "tolerance_used": r.tolerance_used,
            "first_mismatch": r.first_mismatch.model_dump() if r.first_mismatch else None,
            "token_divergence": r.token_divergence.model_dump() if r.token_divergence else None,
            "violations": r.violations, "error": r.error.model_dump() if r.error else None, "seconds": r.seconds}


def _fast_dict(m) -> dict:
    return {"ok": m.ok, "valid": m.valid, "speedup": m.speedup, "ci95": m.speedup_ci95, "bs1_speedup": objective(m)
            if m.ok else None, "tokens_per_s": m.tokens_per_s, "reference_tokens_per_s": m.reference_tokens_per_s,
            "outputs_match": m.outputs_match, "violations": m.violations,
            "shapes": [{"shape": s.shape, "batch": s.batch, "context": s.context, "step_ms": round(s.step_ms, 4),
                        "reference_step_ms": round(s.reference_step_ms, 4), "speedup": round(s.speedup, 4),
                        "tokens_per_s": round(s.tokens_per_s, 1)} for s in m.shapes],
            "error": m.error.model_dump() if m.error else None, "seconds": m.seconds}


def _full_dict(m) -> dict:
    return {"ok": m.ok, "valid": m.valid, "speedup": m.speedup, "ci95": m.speedup_ci95,
            "tokens_per_s": m.tokens_per_s, "reference_tokens_per_s": m.reference_tokens_per_s,
            "per_user_tps_p50": m.per_user_tps_p50, "per_user_tps_p90": m.per_user_tps_p90,
            "ttft_ms_p50": m.ttft_ms_p50, "throughput_tps": m.throughput_tps,
            "reference_throughput_tps": m.reference_throughput_tps, "tokens_match": m.tokens_match,
            "violations": m.violations, "error": m.error.model_dump() if m.error else None, "seconds": m.seconds}


def decode_loop(eng: Engine, cand, prompt: list[int], steps: int, warmup: int, repeats: int) -> dict:
    """Batch-1 greedy decode of `cand` after `prompt` (prefilled by the candidate itself, in
    cache slot 0). On CUDA each step is one CUDA graph (`step_graph`: the forward, the argmax
    into its token input, the position advanced), as gpt-fast's loop captures its sampler; on
    the CPU an eager loop. Returns the loop's tok/s (median of `repeats` runs of `steps`
    steps), the bare replay's tok/s of the engine's own batch-1 graph at the prompt's length
    (the forward alone, what the engine's tiers time), and the greedy tokens."""
    st = eng.candidate_state(cand)
    dev, ctx = eng.device, len(prompt)
    if ctx + steps + 1 > eng.state.max_seq:
        raise ValueError(f"context {ctx} + steps {steps} exceeds the cache's {eng.state.max_seq} positions")
    slot = torch.tensor([0], device=dev)
    with torch.no_grad():
        first = argmax(cand.forward(st, prefill_batch(torch.tensor([prompt], device=dev), slot))).view(-1)  # [1]
        graph = eng.cuda and cand.graphs is not None and cand.graphs.has(st, 1)
        if graph:
            static = eng.inputs.batches[1]
            g = step_graph(cand, st, static)

            def run(n: int, rec: list | None = None) -> None:
                static.tokens.copy_(first.view(1, 1))
                static.positions.fill_(ctx)
                static.slots.fill_(0)
                for _ in range(n):
                    g.replay()
                    if rec is not None:
                        rec.append(static.tokens.clone())
        else:
            def run(n: int, rec: list | None = None) -> None:
                tok = first
                for i in range(n):
                    out = cand.forward(st, decode_batch(tok, torch.tensor([ctx + i], device=dev), slot))
                    tok = argmax(out).view(-1)
                    if rec is not None:
                        rec.append(tok)

        rec: list = []
        run(steps, rec)  # the tokens, and a warm-up
        tokens = [int(first.item())] + [int(t.item()) for t in rec]
        run(warmup)
        loop = [_timed(eng, lambda: run(steps)) / steps for _ in range(repeats)]
        out = {"graph": bool(graph), "context": ctx, "steps": steps, "repeats": repeats}
        sec = statistics.median(loop)
        out |= {"tok_s": round(1 / sec, 1), "us_per_token": round(sec * 1e6, 1), "tokens": tokens}
        if graph:
            static.tokens.copy_(first.view(1, 1))
            static.positions.fill_(ctx)
            rep = [_timed(eng, lambda: [cand.graphs.replay(st, 1) for _ in range(steps)]) / steps
                   for _ in range(repeats)]
            out["replay_tok_s"] = round(1 / statistics.median(rep), 1)
    return out


def step_graph(cand, st, static) -> "torch.cuda.CUDAGraph":
    """One CUDA graph for a whole greedy decode step on the engine's static batch-1 inputs:
    cand.forward, the argmax written into the token input, the position advanced. The
    warm-up before the capture writes K/V at the positions it passes; the caller resets them."""
    def body() -> None:
        out = cand.forward(st, static)
        # engine_server.greedy: torch.argmax's result in two passes, the position's + 1 in the second
        argmax(out, out=static.tokens, advance=static.positions)
    return capture(body)[0]


def _timed(eng: Engine, fn) -> float:
    if eng.cuda:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- the hill-climb ---------------------------------------------------------------------

class Run:
    """The run's shared state: the engine, options, clock, log of every trial."""

    def __init__(self, eng: Engine, args, t0: float):
        self.eng, self.a, self.t0 = eng, args, t0
        self.trials: list[dict] = []
        self.cuda_broken: str | None = None
        self.seeds = tiling_seeds(args.tilings, args.tiling_seeds) if getattr(args, "tilings", "") else []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def note_error(self, text: str | None) -> None:
        if text and self.eng.cuda and not self.cuda_broken and CUDA_BROKEN.search(text):
            self.cuda_broken = text[:300]
            log(f"!! the CUDA context looks broken, the remaining GPU work will fail: {self.cuda_broken}")

    def remove(self, cid: str | None) -> None:
        if cid and cid != REFERENCE:
            try:
                self.eng.remove(cid)
            except Exception:  # noqa: BLE001
                pass

    def try_candidate(self, name: str, source: str, parent: str | None) -> dict:
        """Install + measure_fast twice-if-promising; a row of the climb's log."""
        t = {"name": name, "parent": parent, "ok": False}
        try:
            r = self.eng.submit_forward_pass(source, name=name, parent=parent)
            t |= {"candidate_id": r.candidate_id, "install_s": r.seconds}
            if not r.ok:
                t["error"] = f"{r.error.stage}: {r.error.type}: {r.error.message[:300]}"
                self.note_error(r.error.message)
                return t
            m = self.eng.measure_fast(r.candidate_id)
            if not m.ok or not m.valid:
                t["error"] = (f"{m.error.type}: {m.error.message[:300]}" if m.error else
                              "; ".join(m.violations)[:300])
                self.note_error(t["error"])
                return t
            t |= {"ok": True, "objective": objective(m), "fast_speedup": m.speedup, "samples": [objective(m)]}
        except Exception as e:  # noqa: BLE001 - the engine's own failure on this candidate
            t["error"] = short_error(e)
            self.note_error(t["error"])
        return t

    def climb(self, path: Path, source: str, budget_s: float) -> dict:
        """Coordinate descent over the file's KNOBS; returns the best source and its story."""
        a, stem, deadline = self.a, path.stem, time.perf_counter() + budget_s
        found = find_knobs(source)
        knobs0 = found[0] if found else None
        out = {"file": str(path), "knobs_start": knobs0, "knobs": knobs0, "source": source, "moves": 0,
               "trials": 0, "budget_s": round(budget_s, 1)}
        if not found or not leaves(knobs0) or budget_s <= 0 or self.cuda_broken:
            return out
        span = found[1]
        start = self.try_candidate(stem, source, None)
        start.update(file=str(path), knobs=knobs0, role="start")
        self.trials.append(start)
        if not start["ok"]:
            out["error"] = start.get("error")
            self.remove(start.get("candidate_id"))
            return out
        g = gate(self.eng, start["candidate_id"])
        start["gate"] = g["gate"]
        if g["level"] == 0:
            out["error"] = "the unmodified file fails the gate: not climbed"
            self.remove(start["candidate_id"])
            return out
        best = {"cid": start["candidate_id"], "obj": start["objective"], "knobs": knobs0, "level": g["level"],
                "source": source}
        log(f"   climb {stem}: start x{best['obj']:.4f} over the reference (batch-1 decode), gate {g['gate']}, "
            f"knobs {knobs0}")
        seen = {repr(knobs0)}
        # the tilings measured fastest alone (--tilings): one group's tiling a move, in order
        for group, tiling in self.seeds:
            if time.perf_counter() >= deadline or self.cuda_broken:
                break
            if not isinstance(best["knobs"].get(group), dict):
                continue
            trial_knobs = merged(best["knobs"], {group: tiling})
            if repr(trial_knobs) in seen:
                continue
            seen.add(repr(trial_knobs))
            label = ",".join(f"{k}={v}" for k, v in tiling.items())
            t, best = self._move(path, stem, source, span, (group,), label, trial_knobs, best)
            t["role"] = "seed"
            out["trials"] += 1
            out["moves"] += int(t["accepted"])
        # coordinate descent: each knob in turn (sizes first, switches last), each direction
        # followed while it wins; a step that neither wins nor loses by min_gain (a plateau)
        # is followed by one more step past it; passes repeat while any move was kept and time
        # is left
        paths = sorted((p for p, _ in leaves(knobs0)), key=lambda p: isinstance(_get(knobs0, p), bool))
        improved = True
        while improved and time.perf_counter() < deadline and not self.cuda_broken:
            improved = False
            for kpath in paths:
                for d in range(2):
                    while time.perf_counter() < deadline and not self.cuda_broken:
                        nbs = neighbours(_get(best["knobs"], kpath))
                        if d >= len(nbs):
                            break
                        cur, at = _get(best["knobs"], kpath), best["obj"]
                        trial_knobs = with_value(best["knobs"], kpath, nbs[d])
                        if repr(trial_knobs) in seen:
                            break
                        seen.add(repr(trial_knobs))
                        t, best = self._move(path, stem, source, span, kpath, nbs[d], trial_knobs, best)
                        out["trials"] += 1
                        far = beyond(cur, nbs[d])
                        if (not t["accepted"] and far is not None and t.get("objective")
                                and t["objective"] >= at * (1 - self.a.min_gain)):
                            far_knobs = with_value(best["knobs"], kpath, far)
                            if repr(far_knobs) not in seen:
                                seen.add(repr(far_knobs))
                                t, best = self._move(path, stem, source, span, kpath, far, far_knobs, best)
                                out["trials"] += 1
                        if not t["accepted"]:
                            break
                        out["moves"] += 1
                        improved = True
        self.remove(best["cid"])
        out |= {"knobs": best["knobs"], "source": best["source"], "objective_start": start["objective"],
                "objective_best": best["obj"]}
        return out

    def _move(self, path: Path, stem: str, source: str, span, kpath: tuple, value, knobs: dict,
              best: dict) -> tuple[dict, dict]:
        """Try one knob value against the current best; returns (trial, new best)."""
        key = ".".join(map(str, kpath))
        src = rewrite_knobs(source, span, knobs)
        t = self.try_candidate(f"{stem}[{key}={value}]", src, best["cid"])
        t.update(file=str(path), knobs=knobs, role="move", accepted=False)
        self.trials.append(t)
        gain = 1 + self.a.min_gain
        if t["ok"] and t["objective"] > best["obj"] * gain:
            m2 = self.eng.measure_fast(t["candidate_id"])  # confirm: noise should not win
            if m2.ok and m2.valid:
                t["samples"].append(objective(m2))
            t["objective"] = statistics.mean(t["samples"])
            if t["objective"] > best["obj"] * gain:
                g = gate(self.eng, t["candidate_id"], need=best["level"])
                t["gate"] = g["gate"]
                if g["level"] >= best["level"]:
                    t["accepted"] = True
        log(f"   {t['name']:<44} {'x%.4f' % t['objective'] if t.get('objective') else 'failed':>9} "
            f"{'ACCEPT' if t['accepted'] else '':6} {t.get('gate', '')} {t.get('error') or ''}"[:220])
        if not t["accepted"]:
            self.remove(t.get("candidate_id"))
            return t, best
        self.remove(best["cid"])
        return t, {"cid": t["candidate_id"], "obj": t["objective"], "knobs": knobs, "level": best["level"]
                   if t.get("gate") is None else {"bitwise": 2, "tolerance": 1}.get(t["gate"], 0), "source": src}

    # ---- one clean evaluation of a source ------------------------------------------------

    def evaluate(self, name: str, source: str, prompt: list[int], ref_tokens: list[int] | None) -> dict:
        eng, a = self.eng, self.a
        row: dict = {"name": name, "kind": "candidate"}
        if self.cuda_broken:
            row["error"] = f"skipped: CUDA context broken earlier ({self.cuda_broken[:120]})"
            return row
        cid = None
        try:
            if eng.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            r = eng.submit_forward_pass(source, name=name)
            cid = r.candidate_id
            row |= {"candidate_id": cid, "installed": r.ok, "install_s": r.seconds, "prepare_bytes": r.prepare_bytes,
                    "graphs": len(r.graphs), "notes": r.notes}
            if eng.cuda:
                torch.cuda.synchronize()
                row["install_bytes"] = torch.cuda.memory_allocated() - before  # prepare + its graphs' pool
            if not r.ok:
                row["error"] = f"{r.error.stage}: {r.error.type}: {r.error.message[:500]}"
                self.note_error(r.error.message)
                return row
            g = gate(eng, cid, both=True)
            row |= {"gate": g["gate"], "gate_text": GATE_TEXT[g["gate"]], "bitwise": g["bitwise"],
                    "tolerance": g["tolerance"]}
            row["fast"] = _fast_dict(eng.measure_fast(cid))
            if not a.no_full:
                row["full"] = _full_dict(eng.measure_full(cid))
            if eng.cuda:
                row["engine_peak_bytes"] = torch.cuda.max_memory_allocated()  # install, checks and both tiers
                torch.cuda.reset_peak_memory_stats()
            row["decode"] = decode_loop(eng, eng.candidates[cid], prompt, a.steps, a.warmup, a.repeats)
            if eng.cuda:
                row["decode_peak_bytes"] = torch.cuda.max_memory_allocated()  # the engine while it decodes
                row["engine_peak_bytes"] = max(row["engine_peak_bytes"], row["decode_peak_bytes"])
            row["tok_s"], row["us_per_token"] = row["decode"]["tok_s"], row["decode"]["us_per_token"]
            if ref_tokens:
                row["tokens_match_reference"] = prefix_match(ref_tokens, row["decode"]["tokens"])
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
            row["traceback"] = traceback.format_exc(limit=-4)[-1500:]
            self.note_error(row["error"])
        finally:
            self.remove(cid)
        return row


# ---- the card ----------------------------------------------------------------------------

def gb(x) -> str:
    return f"{x / 1e9:.2f}" if isinstance(x, (int, float)) and x else "-"


def ratio(a, b) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def card(rows: list[dict], ref: dict, compiled: dict | None, hf: dict | None) -> list[str]:
    r_ref = ref.get("tok_s")
    r_cmp = compiled.get("tok_s") if compiled and compiled.get("ok") else None
    r_hf = hf.get("tok_s") if hf and hf.get("ok") else None
    head = (f"{'name':<34} {'tok/s':>8} {'us/tok':>8} {'x ref':>6} {'x compile':>9} {'x HF':>6} {'gate':<10} "
            f"{'fast x':>7} {'full x':>7} {'peak GB':>7} {'dec GB':>6} {'prep MB':>7} {'tok=ref':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r.get("tok_s") or 0
        fast = (r.get("fast") or {}).get("speedup")
        full = (r.get("full") or {}).get("speedup")
        peak = r.get("engine_peak_bytes") or r.get("peak_bytes")
        prep = r.get("prepare_bytes")
        lines.append(
            f"{r['name'][:34]:<34} {t:>8.1f} {r.get('us_per_token') or 0:>8.1f} {ratio(t, r_ref):>6} "
            f"{ratio(t, r_cmp):>9} {ratio(t, r_hf):>6} {r.get('gate', '-'):<10} "
            f"{('%.3f' % fast) if fast else '-':>7} {('%.3f' % full) if full else '-':>7} {gb(peak):>7} "
            f"{gb(r.get('decode_peak_bytes') or r.get('peak_bytes')):>6} "
            f"{('%.1f' % (prep / 2**20)) if isinstance(prep, int) else '-':>7} "
            f"{_match(r, ref):>7}")
        if r.get("error"):
            lines.append(f"    error: {r['error'][:300]}")
    return lines


def _match(r: dict, ref: dict) -> str:
    n = r.get("tokens_match_reference")
    total = len((ref.get("decode") or {}).get("tokens") or [])
    return f"{n}/{total}" if n is not None and total else "-"


# ---- main ------------------------------------------------------------------------------

def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine this run needs: the device's default KV cache, or one long enough for the
    prompt, the warm-up steps and the timed steps (`decode_loop` checks `context + steps + 1`;
    the CPU's default is 512 positions, under the default 512 + 256)."""
    cfg = EngineConfig(model=a.model, shrink=a.shrink, device=a.device, seed=a.seed,
                       call_timeout_s=a.call_timeout_s, fast_rounds=a.fast_rounds)
    need = a.context + a.steps + 1
    return dataclasses.replace(cfg, max_seq=max(need, cfg.resolved().max_seq))


def parser() -> argparse.ArgumentParser:
    p = engine_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("files", nargs="*", help="candidate files (KNOBS literals are hill-climbed)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=256, help="decode steps per timed repeat")
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds for the hill-climb, all files")
    p.add_argument("--total-s", type=float, default=420.0,
                   help="the whole run's target: the climb gets only what is left after the estimate of the rest")
    p.add_argument("--winner-est-s", type=float, default=0.0,
                   help="estimated seconds to evaluate one file (default: 35 on CUDA with the full tier)")
    p.add_argument("--climb", default="", help="comma-separated file stems to hill-climb (default: every file "
                                                 "with KNOBS); the others are evaluated as they are")
    p.add_argument("--start-knobs", default="", help="JSON merged into each climbed file's KNOBS before the climb "
                                                      "(a start point single-knob moves cannot reach)")
    p.add_argument("--variants", default="",
                   help='JSON {"name": {KNOBS overrides}}: copies of the first file with those KNOBS merged in, '
                        'written to --winners-dir (or a temporary folder) as <stem>-<name>.py and evaluated as '
                        'files of their own (not climbed)')
    p.add_argument("--min-gain", type=float, default=0.01, help="a move must beat the best by this fraction")
    p.add_argument("--tilings", default="", help="a stream_bench.py JSON: the climb first tries each projection's "
                   "fastest tilings from it")
    p.add_argument("--tiling-seeds", type=int, default=3, help="tilings a projection taken from --tilings")
    p.add_argument("--winners-dir", default=None, help="write each file's best source and the results here")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--compile-mode", default="reduce-overhead", help="'none': the decoder eagerly")
    p.add_argument("--coordinate-descent", action="store_true",
                   help="Inductor coordinate-descent tuning for the compiled baseline (as gpt-fast sets it; "
                        "longer compile)")
    p.add_argument("--no-full", action="store_true", help="leave out measure_full")
    p.add_argument("--call-timeout-s", type=float, default=90.0, help="per engine call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast-rounds", type=int, default=0, help="the engine's fast-tier rounds (0: its default)")
    return p


def main() -> int:
    a = parser().parse_args()
    t0 = time.perf_counter()
    res: dict = {"bench": "forward", "context": a.context, "steps": a.steps, "files": a.files}

    def checkpoint() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(res | {"partial": True}, indent=2, default=str))

    if why := check_overrides(a):
        print(f"forward_bench: {why}", file=sys.stderr)
        return 2
    log(f"== forward bench: {a.model} on {a.device}, batch 1, context {a.context}, {a.steps} steps")
    eng = Engine(engine_config(a))
    run = Run(eng, a, t0)
    res |= {"model": eng.model.name, "device": a.device, "dtype": eng.config.dtype,
            "startup_s": round(eng.startup_s, 2), "weights": eng.weights_source, "weight_bytes": eng.weight_bytes,
            "hardware": hardware(str(eng.device)).model_dump()}
    log(f"engine ready in {eng.startup_s:.1f} s ({eng.weight_bytes / 1e9:.2f} GB of weights, {eng.weights_source})")
    prompt = eng.traffic.tokens(a.context, 3)
    startup_peak = torch.cuda.max_memory_allocated() if eng.cuda else None

    # 1. the reference
    ref: dict = {"name": "engine reference", "kind": "reference", "gate": "reference",
                 "startup_peak_bytes": startup_peak}
    try:
        if eng.cuda:
            torch.cuda.reset_peak_memory_stats()
        ref["decode"] = decode_loop(eng, eng.candidates[REFERENCE], prompt, a.steps, a.warmup, a.repeats)
        if eng.cuda:
            ref["decode_peak_bytes"] = torch.cuda.max_memory_allocated()
        ref["tok_s"], ref["us_per_token"] = ref["decode"]["tok_s"], ref["decode"]["us_per_token"]
        ref["fast"] = _fast_dict(eng.measure_fast(REFERENCE))  # the reference against itself; builds the schedule
        ref["fast"]["speedup"] = None
        if eng.cuda:  # startup (the reference's install included) was before the reset above
            ref["engine_peak_bytes"] = max(eng.memory()["peak_allocated"], ref.get("startup_peak_bytes", 0))
            ref["engine_memory"] = eng.memory()
    except Exception as e:  # noqa: BLE001
        ref["error"] = short_error(e)
        run.note_error(ref["error"])
    ref_tokens = (ref.get("decode") or {}).get("tokens")
    res["reference"] = ref
    log(f"reference: {ref.get('tok_s')} tok/s greedy loop, replay {ref.get('decode', {}).get('replay_tok_s')} tok/s "
        f"at ctx {a.context} {ref.get('error') or ''}")
    checkpoint()

    # 2. the baselines, on the engine's weights and the same prompt
    dtype = eng.dtype
    base_rows = []
    if not a.skip_compile and not run.cuda_broken:
        mode = None if a.compile_mode == "none" else a.compile_mode
        b = baselines.compiled_decode_rate(eng.model, eng.device, dtype, a.context, a.steps, a.warmup, a.repeats,
                                           weights=eng.state.weights, prompt=prompt, mode=mode,
                                           coordinate_descent=a.coordinate_descent, seed=a.seed)
        base_rows.append(("compile", b))
    if not a.skip_hf and not run.cuda_broken:
        base_rows.append(("hf", baselines.hf_decode_rate(eng.model, eng.device, dtype, a.context, a.steps,
                                                         a.repeats, weights=eng.state.weights, prompt=prompt,
                                                         seed=a.seed)))
    bases = {}
    for key, b in base_rows:
        d = b.to_dict() | {"kind": "baseline", "gate": "-"}
        if ref_tokens and b.tokens:
            d["tokens_match_reference"] = prefix_match(ref_tokens, b.tokens)
        bases[key] = d
        run.note_error(b.error)
        log(f"{b.name}: {b.tok_s} tok/s, compile {b.compile_s} s, peak {gb(b.peak_bytes)} GB "
            f"{'; '.join(b.notes)} {b.error or ''}")
    res["baselines"] = bases
    # they ran in this process: what they left changed among what the engine's process guard
    # watches (torch's settings, the names the reference looks up) is put back and noted here,
    # not charged to the first candidate measured after them
    res["baselines_left_changed"] = eng.process_guard.check()
    if res["baselines_left_changed"]:
        log(f"the baselines left changed (put back): {res['baselines_left_changed']}")
    checkpoint()

    # 3. the hill-climb, through the engine's tools
    files = [Path(f) for f in a.files if is_candidate(_read(Path(f), "def forward(state, batch): ..."))]
    res["not_candidates"] = [f for f in a.files if Path(f) not in files]  # helpers next to them: no `forward`
    if a.variants and files:
        files += write_variants(files[0], json.loads(a.variants),
                                Path(a.winners_dir or tempfile.mkdtemp(prefix="tkcc-variants-")) / "variants")
        res["variants"] = json.loads(a.variants)
    est = a.winner_est_s or ((35.0 if not a.no_full else 13.0) if eng.cuda else 15.0)
    climbable = [f for f in files if (k := find_knobs(_read(f, ""))) and leaves(k[0]) and climbed(a, f)]
    climbs = {}
    for i, f in enumerate(climbable):
        share, why = climb_time(a.budget_s - sum(c.get("spent_s", 0) for c in climbs.values()),
                                a.total_s - run.elapsed() - est * len(files) - 10, len(climbable) - i)
        t = time.perf_counter()
        log(f"-- climb {f.name}: {share:.0f} s" + (f" ({why})" if why else ""))
        try:
            src = _read(f)
            if a.start_knobs:
                src = override_knobs(src, json.loads(a.start_knobs), str(f))
            c = run.climb(f, src, share)
        except Exception as e:  # noqa: BLE001
            c = {"file": str(f), "error": short_error(e), "source": _read(f)}
            run.note_error(c["error"])
        c["spent_s"] = round(time.perf_counter() - t, 1)
        if why:
            c["not_climbed"] = why
        climbs[str(f)] = c
    res["climb"] = {"trials": run.trials, "files": {k: {kk: vv for kk, vv in v.items() if kk != "source"}
                                                    for k, v in climbs.items()}}
    checkpoint()

    # 4. each file's best source, alone on the engine
    winners = []
    for f in files:
        try:
            src = climbs.get(str(f), {}).get("source") or _read(f)
        except OSError as e:
            winners.append({"name": f.stem, "file": str(f), "error": short_error(e)})
            continue
        log(f"-- evaluate {f.stem}")
        row = run.evaluate(f.stem, src, prompt, ref_tokens)
        c = climbs.get(str(f), {})
        row |= {"file": str(f), "knobs_start": c.get("knobs_start"), "knobs": c.get("knobs"),
                "climb_trials": c.get("trials", 0), "climb_moves": c.get("moves", 0)}
        row["_source"] = src
        winners.append(row)
        log(f"   {row.get('tok_s')} tok/s gate {row.get('gate')} fast x{(row.get('fast') or {}).get('speedup')} "
            f"full x{(row.get('full') or {}).get('speedup')} {row.get('error') or ''}")
        res["winners"] = [{k: v for k, v in w.items() if k != "_source"} for w in winners]
        checkpoint()

    # the card
    ok = [w for w in winners if w.get("tok_s")]
    best = max(ok, key=lambda w: w["tok_s"]) if ok else None
    table_rows = [ref] + sorted(winners, key=lambda w: -(w.get("tok_s") or 0)) + list(bases.values())
    lines = card(table_rows, ref, bases.get("compile"), bases.get("hf"))
    log("")
    log(f"== batch-1 greedy decode at context {a.context}, {a.steps} steps x {a.repeats} (median), "
        f"{eng.model.name} {eng.config.dtype} on {res['hardware']['device_name']}")
    for line in lines:
        log(line)
    log("gate: bitwise = " + GATE_TEXT["bitwise"].split(": ", 1)[1] + "; tolerance = "
        + GATE_TEXT["tolerance"].split(": ", 1)[1])
    log("peak GB: engine rows = torch.cuda.max_memory_allocated of the whole engine (weights, their guard copy, "
        "KV cache and the checks' snapshots) with that forward pass installed, through install, both gates, both "
        "tiers and the decode; dec GB = the engine's peak while it decodes; baselines = their own peak above "
        "what was allocated before them")
    if best:
        log(f"best: {best['name']} {best['tok_s']} tok/s = x{ratio(best['tok_s'], ref.get('tok_s'))} the reference, "
            f"x{ratio(best['tok_s'], (bases.get('compile') or {}).get('tok_s'))} torch.compile, "
            f"x{ratio(best['tok_s'], (bases.get('hf') or {}).get('tok_s'))} HF")
    res["table"] = [{"name": r["name"], "kind": r.get("kind"), "tok_s": r.get("tok_s"),
                     "us_per_token": r.get("us_per_token"),
                     "x_reference": _r(r.get("tok_s"), ref.get("tok_s")),
                     "x_compile": _r(r.get("tok_s"), (bases.get("compile") or {}).get("tok_s")),
                     "x_hf": _r(r.get("tok_s"), (bases.get("hf") or {}).get("tok_s")),
                     "gate": r.get("gate"), "peak_bytes": r.get("engine_peak_bytes") or r.get("peak_bytes"),
                     "prepare_bytes": r.get("prepare_bytes"), "error": r.get("error")} for r in table_rows]
    res["best"] = best["name"] if best else None
    res["cuda_broken"] = run.cuda_broken
    res["seconds"] = round(run.elapsed(), 1)
    res["winners"] = [{k: v for k, v in w.items() if k != "_source"} for w in winners]
    if a.winners_dir:
        d = Path(a.winners_dir)
        d.mkdir(parents=True, exist_ok=True)
        for w in winners:
            if w.get("_source") and w.get("gate") in ("bitwise", "tolerance"):
                (d / f"{w['name']}.py").write_text(w["_source"])
        (d / "results.json").write_text(json.dumps(res, indent=2, default=str))
        log(f"winners and results written to {d}")
    log(f"total {res['seconds']} s")
    return emit(res, a.out)


def _r(a, b):
    return round(a / b, 4) if a and b else None


def _read(f: Path, default: str | None = None) -> str:
    try:
        return Path(f).read_text()
    except OSError:
        if default is None:
            raise
        return default


if __name__ == "__main__":
    sys.exit(main())
