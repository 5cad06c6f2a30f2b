"""What every benchmark script shares: the engine flags and the closing JSON line."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def emit(res: dict, out: str | None) -> int:
    """Record the command, print the one JSON line scripts read (last), write --out."""
    res.setdefault("command", " ".join(["python"] + sys.argv))
    print(json.dumps(res, default=str))
    if out:
        Path(out).write_text(json.dumps(res, indent=2, default=str))
    return 0


def host_speed(repeats: int = 5) -> dict:
    """How fast this host runs the single-threaded work a CPU experiment is made of, right now
    (about 0.1-0.3 s): `python_loop_ns`, one iteration of a plain Python loop, and `torch_op_us`,
    one small torch op on one thread (dispatch, not arithmetic); each the median of `repeats`.
    A CPU cycle's seconds scale with these, so results from different hours or hosts compare
    only beside them."""
    loop, op = [], []
    x = torch.ones(128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            t, s = time.perf_counter(), 0
            for i in range(100_000):
                s += i
            loop.append((time.perf_counter() - t) / 100_000 * 1e9)
            t = time.perf_counter()
            for _ in range(2_000):
                x.add(x)
            op.append((time.perf_counter() - t) / 2_000 * 1e6)
    finally:
        torch.set_num_threads(threads)
    return {"python_loop_ns": round(statistics.median(loop), 1), "torch_op_us": round(statistics.median(op), 2)}


def host_line(host: dict) -> str:
    """One card line for `host_speed` readings by name (e.g. {"start": ..., "end": ...})."""
    return (f"this host, {' / '.join(host)}: a Python loop iteration "
            + " / ".join(f"{h['python_loop_ns']:.0f}" for h in host.values()) + " ns, a small torch op "
            + " / ".join(f"{h['torch_op_us']:.2f}" for h in host.values()) + " us")


def capture(step) -> "torch.cuda.CUDAGraph":
    """`step` (CUDA work, no host syncs) run once on a side stream, then captured in a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


def replay_us(g: "torch.cuda.CUDAGraph", replays: int = 50, repeats: int = 5) -> float:
    """The best of `repeats` means over `replays` back-to-back replays of `g`, in us."""
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / replays)
    return best
