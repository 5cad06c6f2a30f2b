"""How fast one program per SM fills its shared memory with weight rows, the memory otherwise
idle: bulk tensor copies (TMA, one mbarrier a program) and cp.async (Gluon, the shims of
`examples/candidates/llama_triton_decode.py`), against a Triton kernel loading the same rows
into registers (a GEMV's loads). What a kernel waiting through the attention chain could have
on chip when it starts, and how soon.

    python benchmarks/smem_fill_bench.py          (bash benchmarks/h200.sh fill)

Each launch reads rows that no launch before it in the graph read (a 1 GiB weight, a new slice
a launch), so L2 holds none of them; a graph of LAUNCHES launches is replayed and timed with
CUDA events, and an empty kernel's launch is the floor subtracted. Every program's result (the
sum of its last tile, read back from shared memory) is checked against torch. Prints a card,
then one JSON line: per method and bytes a program, us a launch, us over the empty launch and
the rate over it (TB/s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit  # noqa: E402
from engine_server.candidate import load_module  # noqa: E402
from engine_server.results import hardware  # noqa: E402

EX = load_module("fill_shims", (Path(__file__).resolve().parent.parent / "examples" / "candidates"
                                / "llama_triton_decode.py").read_text())
if not EX.HAVE_GLUON:
    raise SystemExit("needs Triton with Gluon")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

gluon, gl = EX.gluon, EX.gl
_gl_mb, _gl_cp, _gl_copy, _gl_tma_load, _gl_barrier = EX._gl_mb, EX._gl_cp, EX._gl_copy, EX._gl_tma_load, EX._gl_barrier
K, ROWS, BLOCK_K, REG_K, LAUNCHES = 4096, 32, 64, 256, 32  # the weight's columns; a program's rows


@gluon.jit
def _fill_tma(w_desc, out_ptr, row0, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STEPS: gl.constexpr,
              NW: gl.constexpr):
    """Program p copies rows row0 + p * BLOCK_N.. (STEPS boxes of BLOCK_K columns) into shared
    memory, waits for them, and stores the sum of its last box."""
    pid = gl.program_id(0)
    smem = gl.allocate_shared_memory(w_desc.dtype, [STEPS, BLOCK_N, BLOCK_K], w_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], _gl_mb.MBarrierLayout())
    _gl_mb.init(bar, count=1)
    _gl_mb.expect(bar, STEPS * w_desc.block_type.nbytes)
    for j in gl.static_range(STEPS):
        _gl_tma_load(w_desc, [row0 + pid * BLOCK_N, j * BLOCK_K], bar, smem.index(j))
    _gl_mb.wait(bar, 0)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [NW, 1], [1, 0])
    t = smem.index(STEPS - 1).load(L).to(gl.float32)
    gl.store(out_ptr + pid, gl.sum(gl.sum(t, axis=1), axis=0))


@gluon.jit
def _fill_async(w_ptr, out_ptr, row0, stride, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STEPS: gl.constexpr,
                NW: gl.constexpr):
    """As _fill_tma, by cp.async (16 bytes a thread a copy)."""
    pid = gl.program_id(0)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [NW, 1], [1, 0])
    S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows = row0 + pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, L))
    smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STEPS, BLOCK_N, BLOCK_K], S)
    ptrs = w_ptr + rows.to(gl.int64)[:, None] * stride + cols[None, :]
    for j in gl.static_range(STEPS):
        _gl_copy(smem.index(j), ptrs + j * BLOCK_K)
    _gl_cp.commit_group()
    _gl_cp.wait_group(0)
    _gl_barrier()
    t = smem.index(STEPS - 1).load(L).to(gl.float32)
    gl.store(out_ptr + pid, gl.sum(gl.sum(t, axis=1), axis=0))


@triton.jit
def _fill_regs(w_ptr, out_ptr, row0, stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr):
    """The same rows loaded into registers a tile at a time (each tile summed, so that every
    load is used); stores the sum of the last tile."""
    pid = tl.program_id(0)
    rows = row0 + pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    last = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for j in range(STEPS):
        last = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride + (j * BLOCK_K + cols)[None, :]).to(tl.float32)
        acc += last
    tl.store(out_ptr + pid, tl.sum(tl.sum(last, axis=1), axis=0) + 0.0 * tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0.0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kib", default="16,32,64,128,192", help="KiB a program (32 rows, 512-byte steps)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    limit = EX._smem_capable(dev)
    w = torch.randn((1 << 29) // K, K, device=dev, dtype=torch.bfloat16)  # 1 GiB
    out = torch.zeros(sms, device=dev, dtype=torch.float32)
    desc = EX._gl_desc(w, [ROWS, BLOCK_K])

    def launch(method, steps, row0):
        if method == "tma":
            _fill_tma[(sms,)](desc, out, row0, BLOCK_N=ROWS, BLOCK_K=BLOCK_K, STEPS=steps, NW=4, num_warps=4)
        elif method == "cp.async":
            _fill_async[(sms,)](w, out, row0, w.stride(0), BLOCK_N=ROWS, BLOCK_K=BLOCK_K, STEPS=steps, NW=4,
                                num_warps=4)
        elif method == "registers":
            _fill_regs[(sms,)](w, out, row0, w.stride(0), BLOCK_N=ROWS, BLOCK_K=REG_K,
                               STEPS=steps * BLOCK_K // REG_K, num_warps=4, num_stages=4)
        else:
            _empty[(sms,)](out)

    def check(method, steps, row0):
        out.zero_()
        launch(method, steps, row0)
        torch.cuda.synchronize()
        if method == "empty":
            return True
        end = steps * BLOCK_K
        last = w[:, end - (REG_K if method == "registers" else BLOCK_K): end].float()
        want = torch.stack([last[row0 + i * ROWS: row0 + (i + 1) * ROWS].sum() for i in range(sms)])
        return bool(torch.allclose(out, want, rtol=1e-3, atol=1e-2))

    def timed(method, steps):
        span = sms * ROWS
        slices = w.shape[0] // span
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(LAUNCHES):
                launch(method, steps, (i % slices) * span)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(LAUNCHES):
                launch(method, steps, (i % slices) * span)
        g.replay()
        torch.cuda.synchronize()
        us = []
        for _ in range(a.repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            us.append(e0.elapsed_time(e1) * 1e3 / LAUNCHES)
        return sorted(us)[len(us) // 2]

    rows_out = []
    floor = timed("empty", 1)
    for kib in (int(k) for k in a.kib.split(",")):
        steps = kib * 1024 // (ROWS * BLOCK_K * 2)
        nbytes = steps * ROWS * BLOCK_K * 2
        if steps < REG_K // BLOCK_K or steps * BLOCK_K > K or steps * BLOCK_K % REG_K:
            raise SystemExit(f"--kib {kib}: {REG_K * ROWS * 2 // 1024}..{K * ROWS * 2 // 1024} KiB in steps of "
                             f"{REG_K * ROWS * 2 // 1024}")
        for method in ("tma", "cp.async", "registers"):
            if method != "registers" and nbytes > limit - 1024:
                continue
            ok = check(method, steps, sms * ROWS * 3)
            us = timed(method, steps)
            over = max(us - floor, 1e-9)
            rows_out.append({"method": method, "rows_per_program": ROWS, "kib_per_program": nbytes / 1024,
                             "mb_per_launch": sms * nbytes / 1e6, "us": round(us, 3), "us_over_empty": round(over, 3),
                             "tb_s_over_empty": round(sms * nbytes / over / 1e6, 3), "checked": ok})
    res = {"bench": "smem_fill", "programs": sms, "weight_columns": K, "launches_a_graph": LAUNCHES, "empty_launch_us": floor,
           "rows": rows_out, "hardware": hardware("cuda").model_dump()}
    print(f"== shared-memory fill, one program per SM ({sms}), the memory otherwise idle; "
          f"empty launch {floor:.2f} us in a graph of {LAUNCHES}")
    print(f"{'method':10} {'KiB/prog':>8} {'MB':>6} {'us':>7} {'over':>7} {'TB/s':>6} checked")
    for x in rows_out:
        print(f"{x['method']:10} {x['kib_per_program']:8.0f} {x['mb_per_launch']:6.1f} {x['us']:7.2f} "
              f"{x['us_over_empty']:7.2f} {x['tb_s_over_empty']:6.2f} {x['checked']}")
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
