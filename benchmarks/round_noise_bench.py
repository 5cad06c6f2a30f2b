"""Where the fast tier's noise comes from: reference copies measured with every round kept.

    python benchmarks/round_noise_bench.py --shrink --device cpu --n 40 --rounds 21

Each call runs `--rounds` timed rounds (no early stop) and the timings of every round are
kept. For each timing (a shape at the fast layers or at none) the card gives the spread of
its log ratio against the reference's timing in the same round: robust (IQR / 1.349) and the
5-95% range, which together say whether the noise is a steady jitter or rare outliers. Then,
truncating each call to its first n rounds, the spread across calls of three estimates of the
speedup (a copy's is 1): the fast tier's (the median of per-round ratios of the weighted
sums), per-timing medians of the paired ratios combined, Hodges-Lehmann and the 20%-trimmed
mean of the per-round ratios; and, for the median and the trimmed mean, the mean half-width of
their bootstrap 95% interval and how many calls it would have stopped at +-fast_ci. Last, by
round index, the median across calls of each timing's log ratio and of the round's log
speedup: with `--set '{"warmup_rounds": 0}'` it shows how many first rounds a new pass's
first calls slow (what the warm-up rounds drop). `--set` takes EngineConfig overrides as
JSON. Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server import measure  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.selfcheck import reference_source  # noqa: E402


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=20)
    return {"robust": round((q[14] - q[4]) / 1.349, 4), "p5": round(q[0], 4), "p95": round(q[18], 4)}


def trimmed(x: torch.Tensor, share: float = 0.2) -> torch.Tensor:
    """Mean along the last dim after dropping floor(share * n) values at each end."""
    n = x.shape[-1]
    g = int(share * n)
    return x.sort(dim=-1).values[..., g:n - g].mean(-1)


def trimmed_interval(logs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of exp(trimmed mean) of per-round log ratios (as bootstrap_median)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(logs, dtype=torch.float64)
    vals = trimmed(x[torch.randint(len(logs), (n, len(logs)), generator=g)]).exp().sort().values
    return vals[int(0.025 * n)].item(), vals[min(n - 1, int(0.975 * n))].item()


def round_logs(rounds: list[dict], weights: dict, k: int, layers: int) -> tuple[list[float], callable]:
    """Each round's log speedup (the reference's weighted full-depth estimate over the
    candidate's), and the weighted sum it is taken from ({timing: s} -> s)."""
    def total(t: dict) -> float:
        return sum(w * measure.depth_estimate(t[f"0|{n}"], t[f"k|{n}"], k, layers) for n, w in weights.items())
    return [math.log(total(r["ref"]) / total(r["cand"])) for r in rounds], total


def pair_logs(per_round: list[float]) -> list[float]:
    """Each pair of rounds' mean log speedup (rounds 2j and 2j + 1, which time the two sides in
    opposite orders): what goes first or second in a round cancels within the pair."""
    return [(per_round[j] + per_round[j + 1]) / 2 for j in range(0, len(per_round) - 1, 2)]


def estimates(rounds: list[dict], weights: dict, k: int, layers: int) -> dict[str, float]:
    """The five estimates of one call's log speedup from its rounds ({side: {timing: s}})."""
    per_round, total = round_logs(rounds, weights, k, layers)
    keys = list(rounds[0]["ref"])
    ref = {t: statistics.median(r["ref"][t] for r in rounds) for t in keys}
    cand = {t: ref[t] * statistics.median(r["cand"][t] / r["ref"][t] for r in rounds) for t in keys}
    walsh = [(a + b) / 2 for i, a in enumerate(per_round) for b in per_round[i:]]
    return {"median_of_rounds": statistics.median(per_round), "per_timing_medians": math.log(total(ref) / total(cand)),
            "hodges_lehmann": statistics.median(walsh),
            "trimmed_mean_of_rounds": trimmed(torch.tensor(per_round, dtype=torch.float64)).item(),
            "median_of_pairs": statistics.median(pair_logs(per_round))}


def intervals(rounds: list[dict], weights: dict, k: int, layers: int) -> dict[str, float]:
    """Half-widths (relative) of the bootstrap 95% intervals of the median, the trimmed mean and
    the median of pairs."""
    logs, _ = round_logs(rounds, weights, k, layers)
    ratios = [math.exp(x) for x in logs]
    pairs = [math.exp(x) for x in pair_logs(logs)]
    centre = math.exp(trimmed(torch.tensor(logs, dtype=torch.float64)).item())
    return {"median_of_rounds": measure.half_width(measure.bootstrap_median(ratios), statistics.median(ratios)),
            "trimmed_mean_of_rounds": measure.half_width(trimmed_interval(logs), centre),
            "median_of_pairs": measure.half_width(measure.bootstrap_median(pairs), statistics.median(pairs))}


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--n", type=int, default=40, help="reference copies measured")
    p.add_argument("--rounds", type=int, default=21, help="timed rounds per call, all kept")
    p.add_argument("--at", default="4,6,8,10,12,14,20", help="round counts the estimates are compared at")
    p.add_argument("--set", default="{}", help="JSON: EngineConfig overrides")
    a = p.parse_args()
    at = [int(x) for x in a.at.split(",") if int(x) <= a.rounds]
    calls: list[list[dict]] = []
    timed_round = measure._timed_round

    def keep(eng, sides, plan, r, check, phases=None, ref_skip=frozenset()):
        got = timed_round(eng, sides, plan, r, check, phases, ref_skip)
        if phases is not None:  # the call's own rounds (not its depth check's extra ones)
            calls[-1].append({s: {f"{d}|{n}": v for (d, n), v in got[s].items() if d != "L"} for s in got})
        return got
    measure._timed_round = keep  # before the engine snapshots the module (guards.ProcessGuard)
    try:
        over = json.loads(a.set) | {"fast_rounds": a.rounds, "fast_min_rounds": a.rounds}
        eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device, **over))
        source = reference_source(eng)
        secs, flagged = [], []
        for i in range(a.n + 1):  # the first call pays one-off costs and is dropped
            r = eng.submit_forward_pass(source + f"\n# copy {i}\n")
            calls.append([])
            t = time.perf_counter()
            fm = eng.measure_fast(r.candidate_id)
            secs.append(time.perf_counter() - t)
            assert fm.ok, fm.error
            flagged += [fm.violations] if not fm.valid and i > 0 else []  # a copy flagged: the noise's doing
    finally:
        measure._timed_round = timed_round
    warm = eng.config.warmup_rounds
    calls = [c[warm:warm + a.rounds] for c in calls[1:]]
    weights = {s.name: s.weight for s in eng.fast_setup.shapes}
    k, layers = len(eng.fast_layers), len(eng.state.layers)
    timings = {t: spread([math.log(r["cand"][t] / r["ref"][t]) for c in calls for r in c]) for t in calls[0][0]["ref"]}
    per_n, ci_n = {}, {}
    for n in at:
        est = [estimates(c[:n], weights, k, layers) for c in calls]
        per_n[n] = {name: round(statistics.pstdev(e[name] for e in est), 4) for name in est[0]}
        hw = [intervals(c[:n], weights, k, layers) for c in calls]
        ci_n[n] = {name: {"half_width_mean": round(statistics.mean(h[name] for h in hw), 4),
                          "would_stop": sum(h[name] <= eng.config.fast_ci for h in hw)} for name in hw[0]}
    by_round = {"round": [statistics.median(round_logs([c[j]], weights, k, layers)[0][0] for c in calls)
                          for j in range(a.rounds)]}
    by_round |= {t: [statistics.median(math.log(c[j]["cand"][t] / c[j]["ref"][t]) for c in calls)
                     for j in range(a.rounds)] for t in calls[0][0]["ref"]}
    by_round = {t: [round(x, 4) for x in xs] for t, xs in by_round.items()}
    res = {"bench": "round_noise", "model": a.model, "shrink": a.shrink, "device": a.device, "n": a.n,
           "rounds": a.rounds, "overrides": json.loads(a.set), "weights": weights,
           "call_s_p50": statistics.median(secs[1:]), "copies_flagged": flagged, "timings_log_ratio": timings,
           "estimate_log_spread": per_n, "interval": ci_n, "log_ratio_by_round": by_round, "warmup_rounds": warm, "fast_ci": eng.config.fast_ci, "hardware": hardware(a.device).model_dump()}
    print(f"== fast-tier noise, {a.model}{' shrunk' if a.shrink else ''} on {a.device}: {a.n} reference copies, "
          f"{a.rounds} rounds each")
    print(f"calls {res['call_s_p50']:.3f} s (median); reference copies flagged: {len(flagged)} of {a.n}")
    print("a timing's log ratio against the reference's in the same round:")
    for t, s in timings.items():
        print(f"  {t:34s} robust {s['robust']:.4f}   5% {s['p5']:+.3f}   95% {s['p95']:+.3f}")
    print("spread of a call's log speedup across calls, by the rounds it keeps:")
    for n, row in per_n.items():
        print(f"  {n:3d} rounds: " + "   ".join(f"{name} {v:.4f}" for name, v in row.items()))
    print(f"bootstrap 95% interval, mean half-width (calls within +-{eng.config.fast_ci:g} of {a.n}):")
    for n, row in ci_n.items():
        print(f"  {n:3d} rounds: " + "   ".join(f"{name} {v['half_width_mean']:.4f} ({v['would_stop']})"
                                            for name, v in row.items()))
    print(f"median log ratio by round index (after {warm} warm-up rounds), first rounds:")
    for t, xs in by_round.items():
        print(f"  {t:34s} " + " ".join(f"{x:+.3f}" for x in xs[:6]))
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
