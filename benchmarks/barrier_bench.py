"""What one grid barrier of examples/candidates/llama_triton_persistent.py costs on the GPU.

    python benchmarks/barrier_bench.py [--candidate FILE] [--out F]

One program per SM (all resident, as the example launches them) passes 40 of the example's
own `_barrier`s in a row, in a CUDA graph with the counters' zero fill, replayed 50 times
(best of 5); the cost of one barrier is (that step - the same step with none) / 40, for 16
and 8 warps a program. Every counter must read the number of programs afterwards. Prints a
card, then one JSON line.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import capture, emit, replay_us  # noqa: E402
from engine_server.results import hardware  # noqa: E402

BARRIERS = 40
example = None  # the candidate module whose `_barrier` is timed (--candidate)


def load(path: Path):
    spec = importlib.util.spec_from_file_location("persistent", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@triton.jit
def _barriers(bar_ptr, NB: tl.constexpr, NPROG: tl.constexpr):
    for i in tl.static_range(NB):
        example._barrier(bar_ptr + i, NPROG, 262144)


def step_us(nb: int, nprog: int, warps: int) -> float:
    """Best of 5 means over 50 replays of a graph: zero the counters, pass nb barriers."""
    bar = torch.zeros(max(1, nb), device="cuda", dtype=torch.int32)

    def step():
        bar.zero_()
        _barriers[(nprog,)](bar, NB=nb, NPROG=nprog, num_warps=warps)
    step()
    torch.cuda.synchronize()
    if nb and not bool((bar == nprog).all()):
        raise RuntimeError(f"a barrier's counter is not {nprog}: {bar.tolist()[:8]}")
    g = capture(step)
    return replay_us(g)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--candidate", default=str(ROOT / "examples/candidates/llama_triton_persistent.py"),
                   help="a file defining the Triton function _barrier(bar_ptr, NPROG, SPIN_LIMIT)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    global example
    example = load(Path(a.candidate))
    nprog = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for warps in (16, 8):
        t0, t1 = step_us(0, nprog, warps), step_us(BARRIERS, nprog, warps)
        rows.append({"warps": warps, "programs": nprog, "step_us_none": round(t0, 2),
                     f"step_us_{BARRIERS}": round(t1, 2), "us_per_barrier": round((t1 - t0) / BARRIERS, 3)})
    hw = hardware("cuda")
    print(f"grid barrier of the persistent example, {nprog} programs, {hw.device_name}")
    for r in rows:
        print(f"  {r['warps']:>2} warps: {r['us_per_barrier']:.3f} us a barrier")
    return emit({"bench": "barrier", "candidate": a.candidate, "barriers": BARRIERS, "results": rows,
                 "hardware": hw.model_dump()}, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
