"""What a dependency between two kernels of a decode step costs on the GPU, three ways.

    python benchmarks/sync_bench.py [--out F]

A chain of kernels in one CUDA graph, each program reading a value another program of the
kernel before it wrote (so each link is a true dependency), timed for a short and a long chain;
a link's cost is the difference over the extra links. The ways a kernel waits for the one
before it:
  stream   plain stream order (no PDL)
  pdl      launched early (griddepcontrol.launch_dependents at entry), griddepcontrol.wait
  flag     launched early the same way, then polls a counter every program of the kernel
           before it bumps after its store (release / acquire at GPU scope): no grid-wide wait
  flag_warp  the same, one warp of each program polling, the others at a block barrier
  *_late     the same waits, the next kernel let launch only after them
The counters are zeroed by the graph's first node. Every final value must equal the chain's
length (each link adds one), or the run fails. Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import capture, emit, replay_us  # noqa: E402
from engine_server.results import hardware  # noqa: E402

# name -> (wait: 0 stream order, 1 PDL's grid wait, 2 every thread polls, 3 one warp polls;
#          the next kernel let launch at entry (True) or after the wait (False))
MODES = {"stream": (0, False), "pdl": (1, True), "pdl_late": (1, False), "flag": (2, True),
         "flag_late": (2, False), "flag_warp": (3, True), "flag_warp_late": (3, False)}
SHORT, LONG = 8, 72
GRIDS = ((132, 4), (264, 8), (384, 8), (512, 4))


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _warp_spin(ptr, need):
    """The program's first warp polls the int32 at ptr (acquire loads) until it reaches need;
    then the whole program passes a block barrier."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t, v; mov.u32 t, %tid.x; mov.u32 v, 0; setp.ge.u32 p, t, 32; "
        "@p bra SPUN${:uid}; SPIN${:uid}: ld.acquire.gpu.global.b32 v, [$1]; setp.lt.s32 p, v, $2; "
        "@p bra SPIN${:uid}; fence.acq_rel.gpu; SPUN${:uid}: bar.sync 0; mov.u32 $0, v; }",
        "=r,l,r", [ptr, need], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _link(src, dst, cnt_in, cnt_out, G: tl.constexpr, WAIT: tl.constexpr, EARLY: tl.constexpr,
          FIRST: tl.constexpr):
    pid = tl.program_id(0)
    if (WAIT != 0) & EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if not FIRST:
        if WAIT == 1:
            tl.extra.cuda.gdc_wait()
        if WAIT == 2:
            seen = _load_acquire(cnt_in)
            while seen < G:
                seen = _load_acquire(cnt_in)
        if WAIT == 3:
            _warp_spin(cnt_in, G)
    if (WAIT != 0) & (not EARLY):
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(src + (pid * 7 + 3) % G, cache_modifier=".cg")
    tl.store(dst + pid, v + 1)
    if WAIT >= 2:
        tl.debug_barrier()
        tl.atomic_add(cnt_out, 1, sem="release", scope="gpu")


def chain_us(mode: str, n: int, grid: int, warps: int) -> float:
    """Best of 5 means over 50 replays of a graph: zero the counters, n linked kernels."""
    wait, early = MODES[mode]
    bufs = torch.zeros(n + 1, grid, device="cuda", dtype=torch.int32)
    cnt = torch.zeros(n + 1, device="cuda", dtype=torch.int32)
    extra = {"launch_pdl": True} if wait else {}

    def step():
        cnt.zero_()
        for k in range(n):
            _link[(grid,)](bufs[k], bufs[k + 1], cnt[k], cnt[k + 1], G=grid, WAIT=wait, EARLY=early, FIRST=k == 0,
                           num_warps=warps, **extra)
    step()
    torch.cuda.synchronize()
    g = capture(step)
    bufs.zero_()
    g.replay()
    torch.cuda.synchronize()
    if not bool((bufs[n] == n).all()):
        raise RuntimeError(f"{mode}: a link read before its producer wrote: {bufs[n].tolist()[:8]}")
    return replay_us(g)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for grid, warps in GRIDS:
        for mode in MODES:
            try:
                t0, t1 = chain_us(mode, SHORT, grid, warps), chain_us(mode, LONG, grid, warps)
            except Exception as e:  # noqa: BLE001 - a way that fails (compile, a race) is a result
                rows.append({"mode": mode, "programs": grid, "warps": warps, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            rows.append({"mode": mode, "programs": grid, "warps": warps, f"step_us_{SHORT}": round(t0, 2),
                         f"step_us_{LONG}": round(t1, 2), "us_per_link": round((t1 - t0) / (LONG - SHORT), 3)})
    hw = hardware("cuda")
    print(f"a dependency between two kernels, {hw.device_name}")
    for r in rows:
        what = r.get("error") or f"{r['us_per_link']:.3f} us a link"
        print(f"  {r['programs']:>4} programs x {r['warps']} warps  {r['mode']:<15} {what}")
    return emit({"bench": "sync", "links": [SHORT, LONG], "results": rows, "hardware": hw.model_dump()}, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
