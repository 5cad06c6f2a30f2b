"""What every benchmark script shares: the engine flags and the closing JSON line."""
from __future__ import annotations

import argparse
import json
import sys
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
