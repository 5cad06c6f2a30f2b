"""A cheater's view of the fast tier: submit one of tests/cheaters/ several times, check and
measure each copy, and log every call its forward pass sees during `measure_fast`.

    python benchmarks/cheater_trace.py --device cuda --shrink --n 6 depth_counter

Each line of the card: verdict, speedup and its interval, rounds, how many of the cheater's
no-layer prefills were padded, and the call trace (<layers run><p prefill | d decode>; P: a
padded call, L: full depth). Under CUDA graphs the decode steps replay without calling Python,
so only the eager prefill shows. The log is the cheater's own `forward`, wrapped; which calls
it pads is what the cheater decides (`not state.layers and not any(_recent)`). Prints the
card, then one JSON line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402

CHEATERS = Path(__file__).resolve().parent.parent / "tests" / "cheaters"

# appended to the cheater's module: its forward, wrapped to log each call before it runs
LOGGER = '''

TRACE = []
_cheat = forward


def forward(state, batch):
    padded = not state.layers and not any(globals().get("_recent", [True]))
    TRACE.append((len(state.layers), batch.seq_len, padded))
    return _cheat(state, batch)
'''


def trace_text(calls: list, layers: int) -> str:
    return "".join(("P" if pad else "L" if n == layers else str(n)) + ("p" if t > 1 else "d") for n, t, pad in calls)


def main() -> int:
    p = engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--n", type=int, default=6)
    p.add_argument("cheater", choices=sorted(f.stem for f in CHEATERS.glob("*.py")),
                   help="a file stem under tests/cheaters/")
    a = p.parse_args()
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device, call_timeout_s=120))
    source = (CHEATERS / f"{a.cheater}.py").read_text() + LOGGER
    runs = []
    for i in range(a.n):
        r = eng.submit_forward_pass(source)
        if not r.ok:
            print(f"install failed: {r.error}", file=sys.stderr)
            return 1
        calls = eng.candidates[r.candidate_id].module.TRACE
        ex = eng.check_bit_exact(r.candidate_id)
        calls.clear()
        fm = eng.measure_fast(r.candidate_id)
        trace = trace_text(list(calls), len(eng.state.layers))
        runs.append({"exact": ex.exact, "valid": fm.valid, "speedup": round(fm.speedup, 4),
                     "ci95": [round(x, 4) for x in fm.speedup_ci95], "samples": fm.samples,
                     "padded_prefills": trace.count("Pp"), "padded_decodes": trace.count("Pd"),
                     "graphs": bool(r.graphs), "violations": fm.violations, "trace": trace})
        eng.remove(r.candidate_id)
        x = runs[-1]
        verdict = "caught" if not (x["exact"] and x["valid"]) else "passed"
        print(f"{i}: {verdict:6s} x{x['speedup']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}] {x['samples']} rounds, "
              f"padded prefills {x['padded_prefills']}, decodes {x['padded_decodes']}  {trace[:72]}", file=sys.stderr)
    return emit({"bench": "cheater_trace", "cheater": a.cheater, "model": a.model, "shrink": a.shrink,
                 "device": a.device, "runs": runs}, a.out)


if __name__ == "__main__":
    sys.exit(main())
