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


def host_speed(repeats: int = 5, steps: int = 200) -> dict:
    """How fast this host runs the single-threaded work a CPU experiment is made of, right now
    (about half a second), each the median of `repeats` (the step: of `steps`), on one torch
    thread: `python_loop_ns`, one iteration of a plain Python loop; `torch_op_us`, one small
    torch op (dispatch, not arithmetic); `decode_step_ms`, one batch-1 decode step of the
    reference Llama on the shrunk preset (context 60), outside the engine. A CPU cycle's seconds
    scale with the step, so results from different hours or hosts compare only beside it."""
    from engine_server.config import resolve_model, shrink
    from engine_server.models import llama
    from engine_server.state import State, decode_batch, new_cache
    from engine_server.weights import init_weights
    loop, op, step = [], [], []
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
        cfg = shrink(resolve_model("llama-3.2-1b")[0])
        weights = init_weights(cfg, 0, torch.float32, "cpu")
        k, v = new_cache(cfg, 1, 128, torch.float32, "cpu")
        state = State(cfg, weights, k, v, llama.tables(cfg, weights, 128, torch.float32, "cpu"),
                      tuple(range(cfg.num_layers)))
        batch = decode_batch(torch.tensor([7]), torch.tensor([60]), torch.tensor([0]))
        for i in range(20 + steps):
            t = time.perf_counter()
            llama.forward(state, batch)
            if i >= 20:
                step.append((time.perf_counter() - t) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return {"python_loop_ns": round(statistics.median(loop), 1), "torch_op_us": round(statistics.median(op), 2),
            "decode_step_ms": round(statistics.median(step), 3)}


def host_line(host: dict) -> str:
    """One card line for `host_speed` readings by name (e.g. {"start": ..., "end": ...})."""
    return (f"this host, {' / '.join(host)}: a Python loop iteration "
            + " / ".join(f"{h['python_loop_ns']:.0f}" for h in host.values()) + " ns, a small torch op "
            + " / ".join(f"{h['torch_op_us']:.2f}" for h in host.values()) + " us, the shrunk reference's decode step "
            + " / ".join(f"{h['decode_step_ms']:.2f}" for h in host.values()) + " ms (one thread, outside the engine)")


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
