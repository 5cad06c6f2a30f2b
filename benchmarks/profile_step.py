"""Kernel-time breakdown of one batch-1 decode step of a candidate (eager, after warm-up),
and a determinism check of the reference against itself.

    python benchmarks/profile_step.py --model llama-3.2-1b [--candidate FILE]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.state import decode_batch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--candidate", default=None)
    p.add_argument("--exact-repeats", type=int, default=3)
    a = p.parse_args()
    eng = Engine(EngineConfig(model=a.model, device="cuda"))
    for i in range(a.exact_repeats):
        ex = eng.check_bit_exact("reference")
        print(f"reference vs itself #{i}: exact={ex.exact} mismatch={ex.first_mismatch} {ex.violations}")
    cand = eng.candidates["reference"]
    if a.candidate:
        r = eng.submit_forward_pass(Path(a.candidate).read_text())
        cand = eng.candidates[r.candidate_id]
    st = eng.candidate_state(cand)
    b = decode_batch(torch.tensor([5], device="cuda"), torch.tensor([900], device="cuda"),
                     torch.tensor([0], device="cuda"))
    for _ in range(5):
        cand.forward(st, b)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cand.forward(st, b)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    total, n = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            d = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name[:90]][0] += 1
            per[e.name[:90]][1] += d
            total += d
            n += 1
    print(f"kernels {n}, kernel time {total:.0f} us")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{t:9.1f} us {c:5d}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
