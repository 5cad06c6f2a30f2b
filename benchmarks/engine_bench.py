"""Engine benchmark: decode speed of the reference under CUDA graphs and the latency of each
step of an experiment on the live engine (install + capture, fast tier, exactness, full tier).

    python benchmarks/engine_bench.py --model llama-3.2-1b --device cuda

Prints a card, then one JSON line. Performance figures come from the GPU; on the CPU the
script runs (with --shrink) but its numbers only show the plumbing works.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.selfcheck import reference_source  # noqa: E402
from engine_server.state import decode_batch  # noqa: E402


def decode_rate(eng: Engine, cand, contexts: list[int], iters: int = 200, graphs: bool = True) -> dict:
    """Batch-1 decode tokens/s of `cand` over all layers at each context length."""
    out = {}
    st = eng.candidate_state(cand)
    for ctx in contexts:
        ids = eng.traffic.tokens(ctx + 1, 7)
        slot = torch.tensor([0], device=eng.device)
        from engine_server.state import prefill_batch
        eng.family.forward(eng.state, prefill_batch(torch.tensor([ids[:ctx]], device=eng.device), slot))
        b = decode_batch(torch.tensor([ids[ctx]], device=eng.device), torch.tensor([ctx], device=eng.device), slot)
        use_graph = graphs and eng.cuda and cand.graphs is not None and cand.graphs.has(st, 1)
        if use_graph:
            eng.inputs.fill(b)
        step = (lambda: cand.graphs.replay(st, 1)) if use_graph else (lambda: cand.forward(st, b))
        for _ in range(10):
            step()
        times = []
        for _ in range(5):
            if eng.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(iters):
                    step()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 1e3 / iters)
            else:
                t = time.perf_counter()
                for _ in range(iters):
                    step()
                times.append((time.perf_counter() - t) / iters)
        med = statistics.median(times)
        out[ctx] = {"step_us": round(med * 1e6, 1), "tok_s": round(1 / med, 1), "graph": use_graph}
    return out


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--repeats", type=int, default=3, help="experiments timed on the live engine")
    a = p.parse_args()
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device))
    startup = time.perf_counter() - t0
    ref = eng.candidates["reference"]
    contexts = sorted({s.contexts[0] for s in eng.fast_setup.shapes if s.size == 1} | {128})
    rates = decode_rate(eng, ref, contexts)
    eager = decode_rate(eng, ref, contexts[:1], iters=20, graphs=False)
    src = reference_source(eng)
    cyc = []
    for i in range(a.repeats):
        t = time.perf_counter()
        r = eng.submit_forward_pass(src + f"\n# experiment {i}\n", name=f"copy{i}")
        t_install = time.perf_counter() - t
        m = eng.measure_fast(r.candidate_id)
        t_fast = time.perf_counter() - t
        cyc.append({"install_capture_s": t_install, "install_capture_fast_s": t_fast, "speedup": m.speedup,
                    "ci95": m.speedup_ci95})
    t = time.perf_counter()
    ex = eng.check_bit_exact(r.candidate_id)
    t_exact = time.perf_counter() - t
    t = time.perf_counter()
    full = eng.measure_full(r.candidate_id)  # first call also builds the replay schedule
    t_full_first = time.perf_counter() - t
    t = time.perf_counter()
    full = eng.measure_full(r.candidate_id)
    t_full = time.perf_counter() - t
    mem = eng.memory()
    hw = hardware(str(eng.device))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        smi = None
    res = {
        "bench": "engine", "model": eng.model.name, "device": a.device, "dtype": eng.config.dtype,
        "startup_s": round(startup, 2), "decode_graph": rates, "decode_eager": eager,
        "experiment_cycle_s": {
            "install_capture_p50": round(statistics.median(c["install_capture_s"] for c in cyc), 3),
            "install_capture_fast_p50": round(statistics.median(c["install_capture_fast_s"] for c in cyc), 3)},
        "fast_speedups_of_copies": [[round(c["speedup"], 4), [round(x, 4) for x in c["ci95"]]] for c in cyc],
        "exact_s": round(t_exact, 3), "exact": ex.exact, "full_first_s": round(t_full_first, 3),
        "full_s": round(t_full, 3), "full_over_fast": round(t_full / statistics.median(
            c["install_capture_fast_s"] - c["install_capture_s"] for c in cyc), 2),
        "full": {k: getattr(full, k) for k in ("speedup", "speedup_ci95", "tokens_per_s", "per_user_tps_p50",
                                                "per_user_tps_p90", "ttft_ms_p50", "ttft_ms_p90",
                                                "throughput_tps", "requests", "tokens_match")},
        "memory": mem, "weight_bytes": eng.weight_bytes, "hardware": hw.model_dump(), "nvidia_smi": smi,
    }
    print(f"== tkcc engine bench: {eng.model.name} on {hw.device_name} ({eng.config.dtype})")
    print(f"startup {startup:.1f} s, weights {eng.weight_bytes / 1e9:.2f} GB")
    for ctx, r in rates.items():
        print(f"reference decode B=1 ctx={ctx}: {r['step_us']} us/token = {r['tok_s']} tok/s (graph={r['graph']})")
    for ctx, r in eager.items():
        print(f"reference eager  B=1 ctx={ctx}: {r['tok_s']} tok/s")
    ec = res["experiment_cycle_s"]
    print(f"install+capture {ec['install_capture_p50']} s; +measure_fast {ec['install_capture_fast_p50']} s; "
          f"exact {t_exact:.2f} s; measure_full {t_full:.2f} s (first {t_full_first:.2f} s)")
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
