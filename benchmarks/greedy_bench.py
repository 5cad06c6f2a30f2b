"""The greedy sampler's cost inside a captured decode step: torch.argmax against
engine_server.greedy.argmax's two passes (torch ops, and Triton) at a few slice widths.

    python benchmarks/greedy_bench.py --device cuda [--vocab 128256] [--out F]
    python benchmarks/greedy_bench.py --device cuda --producer lm_head [--hidden 2048]

Each sampler runs in a CUDA graph with the position increment of a decode step (what
benchmarks/forward_bench.py's step graph adds to the forward), replayed back to back; "none"
is that graph without a sampler. Every sampler's token is checked against torch.argmax on
logits with a planted tie (the first index must win).

--producer lm_head puts the step's last GEMV first in each graph: a Triton kernel streaming a
[vocab, hidden] bf16 weight into the logits, waiting and then letting the next kernel launch
as the example candidates' lm_head does with programmatic dependent launch. The step is then
the GPU's to pace, not the host's, and "added" is what the sampler costs after it: the
shipped Triton sampler with plain launches and a separate position add, with PDL launches,
and with PDL and the add in its second kernel (`advance`, as forward_bench's step does).
Without it the graph holds no GEMV, and a replay is the host's launch, under which a few
microseconds of GPU work hide. The graphs' replays are timed in turns, a repeat of each in
each round. Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from engine_server import greedy  # noqa: E402
from engine_server.results import hardware  # noqa: E402

if greedy.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _lm_head_kernel(x_ptr, w_ptr, out_ptr, V, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
        """out[n] = sum_k x[k] * w[n, k] for BLOCK_N rows n a program (float32 sums, out's dtype).
        PDL: wait for the kernel before, then let the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = rows < V
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + cols).to(tl.float32)
            wt = tl.load(w_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=m[:, None], other=0.0)
            acc += tl.sum(wt.to(tl.float32) * xt[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=m)


def capture(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of fn() (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(50):
        g.replay()
    return g


def time_replays(g: "torch.cuda.CUDAGraph", replays: int) -> float:
    """Microseconds per replay of `replays` back-to-back replays of g."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / replays


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", default="128,256,512,1024")
    p.add_argument("--producer", choices=["none", "lm_head"], default="none",
                   help="lm_head: a PDL-launched GEMV writes the logits first in each graph (batch 1)")
    p.add_argument("--hidden", type=int, default=2048, help="the producer's hidden size (a multiple of 256)")
    p.add_argument("--replays", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        print("greedy_bench times CUDA graphs: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    tok = torch.zeros(a.rows, 1, device=dev, dtype=torch.long)
    pos = torch.zeros(a.rows, 1, device=dev, dtype=torch.long)
    tie = (a.vocab // 3, a.vocab * 2 // 3)
    if a.producer == "lm_head":
        if not greedy.HAVE_TRITON or a.rows != 1 or a.hidden % 256:
            print("--producer lm_head: Triton, --rows 1 and a hidden size that 256 divides", file=sys.stderr)
            return 2
        hx = torch.randn(a.hidden, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * 0.01).to(torch.bfloat16)
        w[list(tie)] = (torch.sign(hx.float()) * 0.1).to(torch.bfloat16)  # equal rows, the largest products
        x = torch.empty(a.rows, a.vocab, device=dev, dtype=dtype)
        pdl = greedy.pdl_capable(dev)

        def produce() -> None:
            _lm_head_kernel[(triton.cdiv(a.vocab, 16),)](hx, w, x, a.vocab, D=a.hidden, BLOCK_N=16, BLOCK_K=256,
                                                        PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
        produce()
    else:
        x = torch.randn(a.rows, a.vocab, device=dev, generator=g).to(dtype)
        x[:, list(tie)] = x.max() + 1  # a tie: the first index wins

        def produce() -> None:
            pass
    want = torch.argmax(x, -1, keepdim=True)
    if not bool((want == tie[0]).all()):
        print(f"the planted tie is not the maximum: {want.view(-1).tolist()}", file=sys.stderr)
        return 1

    def step(sample) -> "callable":
        def body() -> None:
            produce()
            sample()
        return body

    def plain(impl: str, pdl: bool | None = None):
        def sample() -> None:
            greedy.argmax(x, out=tok, impl=impl, pdl=pdl)
            pos.add_(1)
        return sample

    cases = [("none", lambda: pos.add_(1), None), ("torch.argmax", plain("torch"), None)]
    if a.producer == "none":
        cases += [(f"two_pass CHUNK={c}", plain("two_pass"), ("two_pass", int(c))) for c in a.chunks.split(",")]
        if greedy.HAVE_TRITON:
            cases += [(f"triton CHUNK={c}", plain("triton"), ("triton", int(c))) for c in a.chunks.split(",")]
    else:
        cases += [("triton, plain launches", plain("triton", pdl=False), None)]
        if pdl:  # the GPU has programmatic dependent launch
            cases += [("triton, PDL", plain("triton", pdl=True), None),
                      ("triton, PDL + advance",
                       lambda: greedy.argmax(x, out=tok, impl="triton", pdl=True, advance=pos), None)]
    shipped = (greedy.CHUNK, greedy.TRITON_CHUNK)
    graphs, rows = [], []
    try:
        for name, sample, chunk in cases:
            if chunk is not None:
                impl, c = chunk
                greedy.CHUNK, greedy.TRITON_CHUNK = (c, shipped[1]) if impl == "two_pass" else (shipped[0], c)
            tok.fill_(-1)
            p0 = pos.clone()
            step(sample)()
            ok = name == "none" or torch.equal(tok, want)
            advanced = bool(torch.equal(pos, p0 + 1))
            graphs.append(capture(step(sample)))  # the chunk is read while capturing
            rows.append({"sampler": name, "equal": ok, "advances": advanced, "us_all": []})
            greedy.CHUNK, greedy.TRITON_CHUNK = shipped
    finally:
        greedy.CHUNK, greedy.TRITON_CHUNK = shipped
    for _ in range(a.repeats):  # in turns: a drift of the clock or the host touches every case alike
        for r, gr in zip(rows, graphs):
            r["us_all"].append(round(time_replays(gr, a.replays), 3))
    for r in rows:
        r["us"] = round(statistics.median(r["us_all"]), 2)
    base = rows[0]["us"]
    for r in rows:
        r["added_us"] = round(r["us"] - base, 2)
    hw = hardware(str(dev))
    what = f"after a {a.vocab} x {a.hidden} lm_head GEMV" if a.producer == "lm_head" else "alone"
    print(f"greedy sampler in a captured step ({what}): {a.rows} x {a.vocab} {a.dtype}, {hw.device_name}")
    for r in rows:
        print(f"  {r['sampler']:<24} {r['us']:8.2f} us a replay  (+{r['added_us']:.2f} over none)  "
              f"{'equal to torch.argmax' if r['equal'] else 'DIFFERS'}{'' if r['advances'] else ', POSITION NOT ADVANCED'}")
    res = {"bench": "greedy", "vocab": a.vocab, "rows": a.rows, "dtype": a.dtype, "producer": a.producer,
           "hidden": a.hidden if a.producer == "lm_head" else None,
           "shipped": {"CHUNK": shipped[0], "TRITON_CHUNK": shipped[1], "cuda_impl": "triton" if greedy.HAVE_TRITON else "two_pass"},
           "results": rows, "hardware": hw.model_dump()}
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
