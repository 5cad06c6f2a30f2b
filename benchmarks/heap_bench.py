"""The CPU heap setting (EngineConfig.cpu_keep_heap, engine_server.heap) against glibc's
defaults: page faults and step-time tails, and what a fast-tier call costs.

    python benchmarks/heap_bench.py --shrink --runs 6 --calls 12 --steps 400

Each run starts two fresh processes, one per setting (their order alternating run to run, so
a slow spell of the host falls on both), each building the engine and then timing `--steps`
single steps of the reference on the fast tier's first decode shape (half as many on its
prefill shape), at its fast layers and at full depth, counting the process's minor page
faults over them; then measuring `--calls` reference copies with measure_fast (the first two
dropped: a process's first calls compile and warm up). Whether glibc's defaults leave a
process's steps faulting their temporaries in afresh depends on that process's history of
allocations, so the card counts the processes that did (more than FAULTY page faults a
step) and gives each process's faults and 90th-percentile step over its median, the median
over runs of each quantile's ratio to the median step, and the fast tier's seconds and
rounds over every call. Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, engine_args  # noqa: E402

QUANTILES = (0.5, 0.9, 0.95, 0.99)
FAULTY = 5.0  # page faults a step above which a process's steps fault their temporaries in afresh


def child(a) -> dict:
    """One process: the engine with cpu_keep_heap=a.keep, its step quantiles and fast-tier calls."""
    from engine_server.engine import Engine, EngineConfig
    from engine_server.selfcheck import reference_source
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device="cpu", cpu_keep_heap=bool(a.keep)))
    ref = eng.candidates["reference"]
    setup = eng.fast_setup
    shapes = [next(s for s in setup.shapes if not s.prefill), next(s for s in setup.shapes if s.prefill)]
    steps = {}
    for sh in shapes:
        for d, layers in (("fast layers", eng.fast_layers), ("full depth", eng.state.layers)):
            st = eng.candidate_state(ref, layers)
            n = a.steps if not sh.prefill else max(50, a.steps // 2)
            ts = []
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(n):  # each step writes the same cells again
                t = time.perf_counter()
                ref.forward(st, sh.batch)
                ts.append(time.perf_counter() - t)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            ts.sort()
            steps[f"{sh.name} at {d}"] = {**{str(q): ts[min(n - 1, int(q * n))] for q in QUANTILES},
                                          "page_faults_per_step": faults / n}
    src = reference_source(eng)
    calls = []
    for i in range(a.calls):
        r = eng.submit_forward_pass(src, name=f"copy{i}")
        t = time.perf_counter()
        m = eng.measure_fast(r.candidate_id)
        calls.append({"seconds": time.perf_counter() - t, "rounds": m.config["stopped"]["rounds"], "valid": m.valid})
    return {"keep_heap": bool(a.keep), "heap_kept": eng.heap_kept, "steps": steps, "calls": calls[2:]}


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--runs", type=int, default=3, help="pairs of processes (one per setting)")
    p.add_argument("--calls", type=int, default=16, help="measure_fast calls a process (two dropped)")
    p.add_argument("--steps", type=int, default=600, help="single steps timed per decode shape and depth")
    p.add_argument("--child", dest="keep", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.keep is not None:
        print("CHILD " + json.dumps(child(a)))
        return 0
    t0 = time.perf_counter()
    runs = {False: [], True: []}
    for i in range(a.runs):
        for keep in ((False, True) if i % 2 == 0 else (True, False)):
            cmd = [sys.executable, __file__, "--model", a.model, "--calls", str(a.calls), "--steps", str(a.steps),
                   "--child", str(int(keep))] + (["--shrink"] if a.shrink else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[keep].append(json.loads([ln for ln in out.splitlines() if ln.startswith("CHILD ")][-1][6:]))
    res = {"bench": "heap", "model": a.model, "shrink": a.shrink, "device": "cpu", "runs": a.runs,
           "calls": a.calls, "steps": a.steps, "settings": {}}
    print(f"== CPU heap: glibc defaults against the kept heap, {a.model}{' (shrunk)' if a.shrink else ''}, "
          f"{a.runs} runs of each")
    for keep, rs in runs.items():
        name = "kept heap" if keep else "glibc defaults"
        tails = {}
        for shape in rs[0]["steps"]:
            med = statistics.median(r["steps"][shape]["0.5"] for r in rs)
            tails[shape] = {"median_us": round(med * 1e6, 1),
                            **{f"p{int(q * 100)}/p50": round(statistics.median(
                                r["steps"][shape][str(q)] / r["steps"][shape]["0.5"] for r in rs), 3)
                               for q in QUANTILES[1:]},
                            "page_faults_per_step": [round(r["steps"][shape]["page_faults_per_step"], 2) for r in rs],
                            "p90/p50_each": [round(r["steps"][shape]["0.9"] / r["steps"][shape]["0.5"], 3) for r in rs]}
        # a process whose steps fault pages in afresh: more than FAULTY page faults a step on some shape
        faulty = [any(r["steps"][sh]["page_faults_per_step"] > FAULTY for sh in r["steps"]) for r in rs]
        calls = [c for r in rs for c in r["calls"]]
        secs = sorted(c["seconds"] for c in calls)
        res["settings"][name] = {
            "heap_kept": [r["heap_kept"] for r in rs], "faulting_processes": sum(faulty), "steps": tails,
            "measure_fast_s": {"p50": round(statistics.median(secs), 4), "mean": round(statistics.mean(secs), 4),
                               "p90": round(secs[int(0.9 * (len(secs) - 1))], 4)} if secs else None,
            "rounds_median": statistics.median(c["rounds"] for c in calls) if calls else None,
            "all_valid": all(c["valid"] for c in calls), "runs": rs}
        print(f"-- {name} (took: {[r['heap_kept'] for r in rs]}): {sum(faulty)} of {len(rs)} processes fault pages "
              f"in afresh (> {FAULTY} a step)")
        for shape, t in tails.items():
            print(f"   {shape:32s} median {t['median_us']:8.1f} us  p90 {t['p90/p50']:.3f}x  p95 {t['p95/p50']:.3f}x  "
                  f"p99 {t['p99/p50']:.3f}x  faults a step {t['page_faults_per_step']}  p90 each {t['p90/p50_each']}")
        if calls:
            s = res["settings"][name]
            print(f"   measure_fast {s['measure_fast_s']['p50']:.4f} s P50, {s['measure_fast_s']['p90']:.4f} s P90 over "
                  f"{len(calls)} calls, rounds median {s['rounds_median']}, all valid {s['all_valid']}")
    if a.calls > 2:
        base, kept = (res["settings"][n]["measure_fast_s"]["p50"] for n in ("glibc defaults", "kept heap"))
        res["measure_fast_ratio"] = round(base / kept, 3)
        print(f"measure_fast P50: defaults / kept heap = {res['measure_fast_ratio']}")
    from engine_server.results import hardware
    res["hardware"] = hardware("cpu").model_dump()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
