"""How close the decode example's GEMV comes to the memory's read bandwidth, alone, by tiling.

    python benchmarks/stream_bench.py [--candidate FILE] [--shapes qkv,o,gate_up,down,lm_head] [--out F]

For each projection of the Llama-3.2-1B preset (bf16 weights, batch 1), called as the decode
step calls it (the norm folded into qkv, gate_up and lm_head, silu(gate) * up out of gate_up, o
and down adding into the float32 residual), each tiling of the candidate's own `_gemv` (its
KNOBS for that projection with BLOCK_N, BLOCK_K, num_warps, REDUCE_EACH, PIPE and, for o and
down, SPLIT_K set) runs over enough copies of the weight that L2 holds none of it from one launch to the next:
one launch a copy, all in one CUDA graph, replayed (best of 5 means of 20). Bandwidth is the
weight's bytes over the time a launch. Beside them, two ceilings over the same copies: a plain
Triton read (each program sums one contiguous run of the weight) and torch's copy (read and
write). Each tiling's output is checked once against a float32 computation and a tiling off by
more than 2% of the largest output is reported wrong. Prints a card (the file's own tiling and
the five fastest a shape), then one JSON line. CUDA only.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import capture, emit, replay_us  # noqa: E402
from engine_server.candidate import load_module  # noqa: E402
from engine_server.results import hardware  # noqa: E402

D, INTER, VOCAB, EPS = 2048, 8192, 128256, 1e-5  # Llama-3.2-1B
QKV = (32 + 2 * 8) * 64  # its q, k and v heads of 64
SHAPES = {"qkv": (QKV, D), "o": (D, D), "gate_up": (2 * INTER, D), "down": (D, INTER),
          "lm_head": (VOCAB, D)}  # weight [rows, K]
SPLITS = {"o": (1, 2), "down": (2, 4)}  # these add into the residual, split along K as tried here
TOLERANCE = 0.02  # of the largest output's magnitude
DEVICE = "cuda"  # where Shape puts its tensors (the tests check its answers on the CPU)


@triton.jit
def _read_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
    """Program p sums elements [p * BLOCK, (p + 1) * BLOCK) of w (a whole number of BLOCKs)."""
    p = tl.program_id(0)
    x = tl.load(w_ptr + p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), eviction_policy="evict_first")
    tl.store(out_ptr + p, tl.sum(x.to(tl.float32), axis=0))


def copies_for(nbytes: int) -> int:
    """Copies of an nbytes weight that are together at least three times the L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, math.ceil(3 * l2 / nbytes))


class Shape:
    """One projection's weight copies, inputs and the float32 answer for the first copy."""

    def __init__(self, name: str, gen: torch.Generator, copies: int | None = None):
        self.name = name
        rows, k = SHAPES[name]
        self.nbytes = rows * k * 2
        self.ws = [torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02
                   for _ in range(copies or copies_for(self.nbytes))]
        if name in SPLITS:
            self.a = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            self.x = torch.zeros(1, rows, device=DEVICE, dtype=torch.float32)
            self.want = self.ws[0].float() @ self.a.float()[0]
        else:
            self.x = torch.randn(1, k, device=DEVICE, dtype=torch.float32, generator=gen)
            self.g = 1 + 0.1 * torch.randn(k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            h = self.x[0] * torch.rsqrt(self.x[0].pow(2).mean() + EPS) * self.g.float()
            y = self.ws[0].float() @ h
            self.want = F.silu(y[:rows // 2]) * y[rows // 2:] if name == "gate_up" else y

    def call(self, mod, w: torch.Tensor) -> torch.Tensor:
        if self.name in SPLITS:
            return mod._gemv(self.a, w, self.name, into=self.x)
        return mod._gemv(self.x, w, self.name, out_dtype=torch.bfloat16, silu=self.name == "gate_up",
                         norm=(self.g, EPS))

    def error(self, mod) -> float:
        """The first copy's output against the float32 answer, over the largest output."""
        if self.name in SPLITS:
            self.x.zero_()
        got = self.call(mod, self.ws[0]).float().reshape(-1)
        return float((got - self.want).abs().max() / self.want.abs().max())

    def gbs(self, us: float) -> float:
        return self.nbytes / us / 1e3

    def launch_us(self, launch) -> float:
        """`launch(w)` on every copy in one graph, replayed: us a launch."""
        g = capture(lambda: [launch(w) for w in self.ws])
        return replay_us(g, replays=20) / len(self.ws)


def gemv_row(mod, shape: Shape, knobs: dict) -> dict:
    """One tiling of the candidate's GEMV over every copy: its error, us a launch and GB/s."""
    saved = dict(mod.KNOBS[shape.name])
    mod.KNOBS[shape.name].update(knobs)
    row = {"shape": shape.name, "knobs": knobs}
    try:
        row["error"] = round(shape.error(mod), 5)
        us = shape.launch_us(lambda w: shape.call(mod, w))
        row.update(us=round(us, 2), gbs=round(shape.gbs(us), 1), ok=row["error"] <= TOLERANCE)
    except Exception as e:  # noqa: BLE001 - a tiling the kernel or the GPU refuses is a row, not the end
        row.update(ok=False, failure=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        mod.KNOBS[shape.name].clear()
        mod.KNOBS[shape.name].update(saved)
    return row


def ceilings(shape: Shape) -> list[dict]:
    """A plain contiguous Triton read and torch's copy over the same copies, as GB/s of the weight."""
    rows = []
    for block, warps in itertools.product((4096, 16384), (4, 8)):
        n = shape.ws[0].numel()
        out = torch.empty(n // block, device="cuda", dtype=torch.float32)
        us = shape.launch_us(lambda w: _read_kernel[(n // block,)](w, out, BLOCK=block, num_warps=warps))
        rows.append({"shape": shape.name, "ceiling": f"triton read, {block} elements a program, {warps} warps",
                     "us": round(us, 2), "gbs": round(shape.gbs(us), 1)})
    dst = torch.empty_like(shape.ws[0])
    us = shape.launch_us(dst.copy_)
    rows.append({"shape": shape.name, "ceiling": "torch copy (read + write: twice the bytes)", "us": round(us, 2),
                 "gbs": round(2 * shape.gbs(us), 1)})
    return rows


def tilings(name: str) -> list[dict]:
    modes = ((False, False), (True, False), (True, True))  # (REDUCE_EACH, PIPE)
    grid = itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), modes)
    out = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "REDUCE_EACH": r, "PIPE": p} for n, k, w, (r, p) in grid]
    if name in SPLITS:
        k = SHAPES[name][1]
        out = [dict(t, SPLIT_K=s) for t in out for s in SPLITS[name] if t["BLOCK_K"] <= k // s]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--candidate", default=str(ROOT / "examples/candidates/llama_triton_decode_h200.py"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}: choose from {','.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("stream_bench: needs CUDA", file=sys.stderr)
        return 1
    mod = load_module("stream", Path(a.candidate).read_text())
    gen = torch.Generator(device="cuda").manual_seed(0)
    hw = hardware("cuda")
    print(f"the GEMV's streaming bandwidth alone, {hw.device_name}, {Path(a.candidate).name}")
    results = []
    for name in a.shapes.split(","):
        shape = Shape(name, gen)
        own = {k: mod.KNOBS[name][k] for k in ("BLOCK_N", "BLOCK_K", "num_warps", "REDUCE_EACH", "PIPE", "SPLIT_K")
               if k in mod.KNOBS[name]}
        rows = [dict(gemv_row(mod, shape, {}), own=True)] + [gemv_row(mod, shape, t) for t in tilings(name)]
        ceil = ceilings(shape)
        best = sorted((r for r in rows if r.get("ok")), key=lambda r: r["us"])
        print(f"== {name}: {shape.nbytes / 1e6:.1f} MB, {len(shape.ws)} copies")
        for c in ceil:
            print(f"   {c['gbs']:7.1f} GB/s  {c['us']:8.2f} us  {c['ceiling']}")
        r0 = rows[0]
        print(f"   {r0.get('gbs', 0):7.1f} GB/s  {r0.get('us', 0):8.2f} us  the file's tiling {own}"
              f" (error {r0.get('error')})")
        for r in best[:5]:
            print(f"   {r['gbs']:7.1f} GB/s  {r['us']:8.2f} us  {r['knobs']}")
        wrong = [r for r in rows if not r.get("ok")]
        if wrong:
            print(f"   {len(wrong)} tilings failed or were wrong, e.g. {wrong[0]}")
        results.append({"shape": name, "bytes": shape.nbytes, "copies": len(shape.ws), "file_tiling": own,
                        "rows": rows, "ceilings": ceil})
        del shape
        torch.cuda.empty_cache()
    return emit({"bench": "stream", "candidate": a.candidate, "results": results, "hardware": hw.model_dump()},
                a.out)


if __name__ == "__main__":
    raise SystemExit(main())
