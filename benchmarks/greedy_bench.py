"""The greedy sampler's cost inside a captured decode step: torch.argmax against
engine_server.greedy.argmax's two passes (torch ops, and Triton) at a few slice widths.

    python benchmarks/greedy_bench.py --device cuda [--vocab 128256] [--out F]

Each sampler runs in a CUDA graph with the position increment of a decode step (what
benchmarks/forward_bench.py's step graph adds to the forward), replayed back to back; "none"
is that graph without a sampler. Every sampler's token is checked against torch.argmax on
logits with a planted tie (the first index must win). Prints a card, then one JSON line.
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


def time_graph(fn, pos: torch.Tensor, replays: int, repeats: int) -> float:
    """Median microseconds per replay of a graph of fn() and pos += 1."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
            pos.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
        pos.add_(1)
    for _ in range(50):
        g.replay()
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / replays)
    return statistics.median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", default="128,256,512,1024")
    p.add_argument("--replays", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        print("greedy_bench times CUDA graphs: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.rows, a.vocab, device=dev, generator=g).to(getattr(torch, a.dtype))
    x[:, a.vocab * 2 // 3] = x[:, a.vocab // 3] = x.max() + 1  # a tie: the first index wins
    want = torch.argmax(x, -1, keepdim=True)
    tok = torch.zeros(a.rows, 1, device=dev, dtype=torch.long)
    pos = torch.zeros(1, device=dev, dtype=torch.long)
    cases = [("none", None, 0), ("torch.argmax", "torch", 0)]
    cases += [(f"two_pass CHUNK={c}", "two_pass", int(c)) for c in a.chunks.split(",")]
    if greedy.HAVE_TRITON:
        cases += [(f"triton CHUNK={c}", "triton", int(c)) for c in a.chunks.split(",")]
    shipped = (greedy.CHUNK, greedy.TRITON_CHUNK)
    rows = []
    try:
        for name, impl, chunk in cases:
            greedy.CHUNK, greedy.TRITON_CHUNK = (chunk, shipped[1]) if impl == "two_pass" else (shipped[0], chunk or shipped[1])
            fn = (lambda: None) if impl is None else (lambda impl=impl: greedy.argmax(x, out=tok, impl=impl))
            tok.fill_(-1)
            fn()
            ok = impl is None or torch.equal(tok, want)
            rows.append({"sampler": name, "us": round(time_graph(fn, pos, a.replays, a.repeats), 2), "equal": ok})
    finally:
        greedy.CHUNK, greedy.TRITON_CHUNK = shipped
    base = rows[0]["us"]
    for r in rows:
        r["added_us"] = round(r["us"] - base, 2)
    hw = hardware(str(dev))
    print(f"greedy sampler in a captured step: {a.rows} x {a.vocab} {a.dtype}, {hw.device_name}")
    for r in rows:
        print(f"  {r['sampler']:<22} {r['us']:8.2f} us a replay  (+{r['added_us']:.2f} over none)  "
              f"{'equal to torch.argmax' if r['equal'] else 'DIFFERS'}")
    res = {"bench": "greedy", "vocab": a.vocab, "rows": a.rows, "dtype": a.dtype,
           "shipped": {"CHUNK": shipped[0], "TRITON_CHUNK": shipped[1], "cuda_impl": "triton" if greedy.HAVE_TRITON else "two_pass"},
           "results": rows, "hardware": hw.model_dump()}
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
