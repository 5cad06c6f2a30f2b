"""Kernel-time breakdown of one batch-1 decode step of a candidate, and a determinism check
of the reference against itself.

    python benchmarks/profile_step.py --model llama-3.2-1b [--candidate FILE] [--order]

The step is the candidate's captured batch-1 CUDA graph, replayed (eager if it has none),
after warm-up. Prints kernel time by kernel name; with --order, each kernel in the order it
ran with its start relative to the end of the one before (negative: they overlapped, as
programmatic dependent launch lets them), the step's span from first start to last end, and
for Triton GEMVs (qkv, o, gate_up, down per layer, then lm_head) the time by projection. With
--resources, each Triton kernel the candidate compiled: registers, spills, shared memory,
warps, its block-size constexprs, and how many of its programs one SM holds by registers
(65,536 a multiprocessor, allocated per warp in 256s) and by warps (64).
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
    p.add_argument("--order", action="store_true", help="list the kernels in order, with gaps and overlaps")
    p.add_argument("--resources", action="store_true", help="registers, spills and programs per SM of each kernel")
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
    graph = cand.graphs is not None and cand.graphs.has(st, 1)
    if graph:
        eng.inputs.fill(b)

    def step() -> None:
        if graph:
            cand.graphs.replay(st, 1)
        else:
            cand.forward(st, b)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per = collections.defaultdict(lambda: [0, 0.0])
    total = 0.0
    for e in kernels:
        d = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        per[e.name[:90]][0] += 1
        per[e.name[:90]][1] += d
        total += d
    print(f"{'graph replay' if graph else 'eager'}: kernels {len(kernels)}, kernel time {total:.0f} us")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{t:9.1f} us {c:5d}x  {name}")
    if a.order and kernels:
        span = kernels[-1].time_range.end - kernels[0].time_range.start
        gaps = [k.time_range.start - j.time_range.end for j, k in zip(kernels, kernels[1:])]
        print(f"span {span:.0f} us (first start to last end); between kernels: {sum(g for g in gaps if g > 0):.0f} us "
              f"idle, {-sum(g for g in gaps if g < 0):.0f} us overlapped")
        gemv = [e for e in kernels if "_gemv_kernel" in e.name]
        layers = len(st.layers)
        if len(gemv) == 4 * layers + 1:
            by = collections.defaultdict(float)
            for i, e in enumerate(gemv):
                by["lm_head" if i == len(gemv) - 1 else ("qkv", "o", "gate_up", "down")[i % 4]] += e.time_range.elapsed_us()
            wb = {"qkv": "self_attn.qkv_proj.weight", "o": "self_attn.o_proj.weight",
                  "gate_up": "mlp.gate_up_proj.weight", "down": "mlp.down_proj.weight"}
            for proj, us in by.items():
                if proj == "lm_head":
                    nbytes = eng.model.vocab_size * eng.model.hidden_size * eng.state.dtype.itemsize
                else:
                    t = {**eng.state.weights, **eng.state.tables}[f"model.layers.{st.layers[0]}.{wb[proj]}"]
                    nbytes = t.numel() * t.element_size() * layers
                print(f"  gemv {proj:<8} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s")
        for gap, e in zip([0.0] + gaps, kernels):
            print(f"  {gap:+7.1f} {e.time_range.elapsed_us():7.1f} us  {e.name[:60]}")
    if a.resources and cand.module is not None:
        resources(cand.module)
    return 0


SHOWN = ("SILU", "ATOMIC", "FOLD", "BLOCK_N", "BLOCK_K", "PRE_K", "PHASE", "BLOCK_S", "NSPLIT", "L2_AT")


def resources(module) -> None:
    """Print each compiled variant of the module's Triton kernels (see the module docstring)."""
    from triton.runtime.jit import JITFunction

    from benchmarks.kernel_resources import residency
    for name, fn in sorted(vars(module).items()):
        if not isinstance(fn, JITFunction):
            continue
        for cache in fn.device_caches.values():
            for k in cache[0].values():
                k._init_handles()
                warps = k.metadata.num_warps
                by_regs, by_warps, by_shared, _ = residency(k.n_regs, warps, k.metadata.shared)
                shown = {}
                for c, v in (getattr(getattr(k, "src", None), "constants", None) or {}).items():
                    c = c[0] if isinstance(c, tuple) and c else c  # (index,) keys in some Triton versions
                    c = fn.arg_names[c] if isinstance(c, int) and c < len(fn.arg_names) else c
                    if c in SHOWN:
                        shown[c] = v
                print(f"  {name:<22} regs {k.n_regs:3d} spills {k.n_spills:4d} shared {k.metadata.shared:6d} "
                      f"warps {warps:2d} per SM: {by_regs} by registers, {by_warps} by warps, {by_shared} by shared "
                      f"memory  {shown}")


if __name__ == "__main__":
    sys.exit(main())
