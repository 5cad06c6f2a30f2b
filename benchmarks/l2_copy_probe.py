"""Does a device-to-device copy on a side stream leave its source in L2 for the next kernel?

    python3 benchmarks/l2_copy_probe.py          # CUDA only; prints a card, then one JSON line

The decode step's attention chain leaves the memory idle for a few microseconds a layer. A
kernel that prefetches the next weights there competes with the attention for the SMs; a
copy (cudaMemcpyAsync, device to device: a copy engine) on a side stream might not. Each
trial, captured in one CUDA graph as the step would be: L2 flushed (a buffer twice its size
read), then on the main stream a spin for a window (the attention, about 5 us), then a
GEMV reads W (an o_proj-sized [2048, 2048] bf16 weight, or gate_up's rows). During the window
a side stream (a parallel branch of the graph) does nothing (`none`), copies W to scratch
(`copy`), or reads W in a kernel (`sum`: the SM prefetch); `warm` reads W on the main stream
before the window (the best an L2 prefetch can do). The card gives, per mode, the median
time of a replay and the GEMV's own time (eager), and whether every replay's GEMV (and copy)
gave torch's result (`checked`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from engine_server.results import hardware  # noqa: E402

MODES = ("none", "copy", "sum", "warm")


def sleep_cycles_per_us() -> float:
    """What torch.cuda._sleep's argument is worth in microseconds here."""
    torch.cuda._sleep(100_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(1_000_000)
    b.record()
    torch.cuda.synchronize()
    return 1_000_000 / (a.elapsed_time(b) * 1e3)


def record(mode: str, w, x, y, scratch, acc, flush, flushed, side, cycles: int, ev: list | None) -> None:
    """One trial's work on the current (main) stream; `ev`: [start, read, end] events to record
    (None while a graph captures it)."""
    main = torch.cuda.current_stream()
    torch.amax(flush, dim=0, out=flushed)  # L2 now holds the flush buffer's (clean) lines
    if mode == "warm":
        torch.sum(w, dim=(0, 1), dtype=torch.float32, out=acc)
    if ev:
        ev[0].record(main)
    if mode in ("copy", "sum"):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if mode == "copy":
                scratch.copy_(w)
            else:
                torch.sum(w, dim=(0, 1), dtype=torch.float32, out=acc)
    torch.cuda._sleep(cycles)
    if mode in ("copy", "sum"):
        main.wait_stream(side)
    if ev:
        ev[1].record(main)
    torch.mv(w, x, out=y)
    if ev:
        ev[2].record(main)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--window-us", type=float, default=5.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    flush = torch.ones(2 * l2 // 4 // 1024, 1024, dtype=torch.float32, device=dev)
    flushed = torch.empty(1024, dtype=torch.float32, device=dev)
    side = torch.cuda.Stream()
    cycles = round(args.window_us * sleep_cycles_per_us())
    rows = {"o_proj [2048, 2048]": 2048, "gate_up rows [4096, 2048]": 4096, "gate_up rows [8192, 2048]": 8192}
    out = {"window_us": args.window_us, "window_cycles": cycles, "l2_bytes": l2, "reps": args.reps, "shapes": {}}
    print(f"== L2 by a side-stream copy, {props.name}: a {args.window_us:g} us window, then a GEMV; "
          f"graphs, {args.reps} trials a mode, interleaved")
    for name, n in rows.items():
        w = torch.randn(n, 2048, dtype=torch.bfloat16, device=dev)
        x = torch.randn(2048, dtype=torch.bfloat16, device=dev)
        y = torch.empty(n, dtype=torch.bfloat16, device=dev)
        scratch, acc = torch.empty_like(w), torch.empty((), dtype=torch.float32, device=dev)
        graphs = {}
        for mode in MODES:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up outside the graph
                record(mode, w, x, y, scratch, acc, flush, flushed, side, cycles, None)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                record(mode, w, x, y, scratch, acc, flush, flushed, side, cycles, None)
            graphs[mode] = g
        want = torch.mv(w, x)
        got = {m: [] for m in MODES}
        checked = {}
        for _ in range(args.reps):
            for mode in MODES:
                y.zero_()
                scratch.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[mode].replay()
                b.record()
                torch.cuda.synchronize()
                got[mode].append(a.elapsed_time(b) * 1e3)
                # the replay computed the GEMV (and, copying, the copy) it is timed for
                checked[mode] = checked.get(mode, True) and torch.equal(y, want) and (
                    mode != "copy" or torch.equal(scratch, w))
        read = {}
        for mode in MODES:  # the GEMV's own time, eagerly, in the state the graph leaves before it
            xs = []
            for _ in range(args.reps):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                record(mode, w, x, y, scratch, acc, flush, flushed, side, cycles, ev)
                torch.cuda.synchronize()
                xs.append(ev[1].elapsed_time(ev[2]) * 1e3)
            read[mode] = round(statistics.median(xs), 2)
        res = {m: {"replay_us": round(statistics.median(got[m]), 2), "gemv_eager_us": read[m],
                   "checked": checked[m]} for m in MODES}
        size = w.numel() * w.element_size()
        out["shapes"][name] = {"bytes": size, **res}
        print(f"{name} ({size / 1e6:.1f} MB), replay (flush + window + GEMV) / the GEMV alone, eager:")
        for m, r in res.items():
            print(f"  {m:5s} {r['replay_us']:7.1f} us  {r['gemv_eager_us']:6.1f} us"
                  + ("" if r["checked"] else "  (its output differs from torch.mv's)"))
    # what runs the copy: a copy engine (a "Memcpy DtoD" activity) or a kernel
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scratch.copy_(w)
        torch.cuda.synchronize()
    out["copy_runs_as"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    print("the copy runs as:", out["copy_runs_as"])
    out["hardware"] = hardware("cuda").model_dump()
    emit(out, args.out)


if __name__ == "__main__":
    main()
