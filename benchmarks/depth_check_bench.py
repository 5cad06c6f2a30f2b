"""What the fast tier's depth check costs and what it catches, for several numbers of
rounds that time full depth: copies of the reference (must pass, their full-depth ratio
close to the reference's), a copy that runs the reference --slow times a step (an honest
pass that much slower: must pass) and the depth padder of tests/cheaters (must be
flagged), interleaved in one engine so every setting sees the same machine; with --files,
candidate files too (correct passes: their ratios show how far a real pass's time departs
from the extrapolation's straight line; they must pass). Each run's "relative" is its worst
full-depth ratio over the reference's (the depth check), "estimate" its worst speedup over
its speedup at full depth, over the reference's ratio (the estimate check); both are judged
against the slack.

    python benchmarks/depth_check_bench.py --shrink --device cpu --n 30 --reps 5,3 3,3
    python benchmarks/depth_check_bench.py --shrink --device cpu --n 40 --reps 3,3 --slow 3
    python benchmarks/depth_check_bench.py --shrink --device cuda --n 6 --reps 5,2 \
        --files examples/candidates/llama_triton_decode.py --fast-fraction 0.5

`--reps D,P`: the least check rounds for the decode shape, D, and for an extrapolated
prefill, P (the engine's DEPTH_REPS / DEPTH_REPS_PREFILL; each timed round is a check round
with the chance D / fast_min_rounds, P / fast_min_rounds). Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server import measure  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.selfcheck import reference_source  # noqa: E402

PADDER = Path(__file__).resolve().parent.parent / "tests" / "cheaters" / "depth_padder.py"


def relative(m) -> float:
    """The candidate's worst full-depth-over-extrapolation ratio relative to the reference's."""
    return max(v["cand"] / v["ref"] for v in m.config["depth_check"].values())


def estimate(m) -> float:
    """The candidate's worst speedup over its speedup at full depth, relative to the
    reference's full depth over its extrapolation (`measure._estimate_check`)."""
    return max(v["cand_over_estimate"] / v["ref"] for v in m.config["depth_check"].values())


def slow_source(copy: str, times: int) -> str:
    """The reference copy `copy` with its forward run `times` times a step (the last output
    returned): an honest pass that many times slower."""
    return copy + (f"\n\n_forward = forward\n\n\ndef forward(state, batch):\n"
                   f"    for _ in range({times}):\n        out = _forward(state, batch)\n    return out\n")


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--n", type=int, default=20, help="reference copies per setting (padders: half as many)")
    p.add_argument("--reps", nargs="+", default=["5,3", "3,3"], help="decode,prefill least check rounds per setting")
    p.add_argument("--files", nargs="*", default=[], help="candidate files measured beside the copies (n each)")
    p.add_argument("--fast-fraction", type=float, default=None, help="the engine's fast_fraction (default its own)")
    p.add_argument("--slow", type=int, default=3, help="the slow copy runs the reference this many times a step "
                   "(0: no slow copy)")
    a = p.parse_args()
    settings = [tuple(int(x) for x in r.split(",")) for r in a.reps]
    ff = {} if a.fast_fraction is None else {"fast_fraction": a.fast_fraction}
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device, **ff))
    kind = "cuda" if eng.cuda else "cpu"
    copy, pad = reference_source(eng), PADDER.read_text()
    files = {Path(f).stem: Path(f).read_text() for f in a.files}
    if a.slow:
        files = {f"slow{a.slow}": slow_source(copy, a.slow), **files}
    runs = {s: {"copy": [], "padder": [], **{k: [] for k in files}} for s in settings}
    for i in range(a.n * len(settings)):
        s = settings[i % len(settings)]
        measure.DEPTH_REPS[kind], measure.DEPTH_REPS_PREFILL[kind] = s
        jobs = [("copy", copy)] + ([("padder", pad)] if i // len(settings) % 2 == 0 else []) + list(files.items())
        for what, src in jobs:
            m = eng.measure_fast(eng.submit_forward_pass(src + f"\n# {what} {i}\n").candidate_id)
            checks = m.config["depth_check"].values()
            runs[s][what].append({"valid": m.valid, "relative": round(relative(m), 3),
                                  "estimate": round(estimate(m), 3),
                                  "rechecked": any(v["rechecked"] for v in checks),
                                  "estimate_rechecked": any(v["estimate_rechecked"] for v in checks),
                                  "total_s": m.config["phases_s"]["total"],
                                  "depth_check_s": m.config["phases_s"]["depth_check"]})
    res = {"bench": "depth_check", "model": a.model, "shrink": a.shrink, "device": a.device, "n": a.n,
           "fast_layers": list(eng.fast_layers), "slack": measure.DEPTH_SLACK[kind], "settings": []}
    print(f"== depth check on {a.device}, {a.model}{' shrunk' if a.shrink else ''} (fast layers "
          f"{list(eng.fast_layers)}): {a.n} reference copies, {(a.n + 1) // 2} depth padders"
          f"{' and each file' if files else ''} per setting, slack {measure.DEPTH_SLACK[kind]}")
    for s in settings:
        c, d = runs[s]["copy"], runs[s]["padder"]
        row = {"decode_rounds": s[0], "prefill_rounds": s[1],
               "fast_s_p50": statistics.median(x["total_s"] for x in c),
               "depth_check_s_p50": statistics.median(x["depth_check_s"] for x in c),
               "copies_flagged": sum(not x["valid"] for x in c), "copies_rechecked": sum(x["rechecked"] for x in c),
               "copies_relative": sorted(x["relative"] for x in c),
               "copies_estimate_rechecked": sum(x["estimate_rechecked"] for x in c),
               "copies_estimate": sorted(x["estimate"] for x in c),
               "padders_caught": sum(not x["valid"] for x in d), "padders": len(d),
               "padders_relative": sorted(x["relative"] for x in d),
               "padders_estimate": sorted(x["estimate"] for x in d),
               "files": {k: {"flagged": sum(not x["valid"] for x in runs[s][k]),
                             "relative": sorted(x["relative"] for x in runs[s][k]),
                             "estimate_rechecked": sum(x["estimate_rechecked"] for x in runs[s][k]),
                             "estimate": sorted(x["estimate"] for x in runs[s][k])} for k in files}}
        res["settings"].append(row)
        print(f"rounds {s[0]} decode, {s[1]} prefill: fast tier {row['fast_s_p50']:.3f} s a call "
              f"(depth check {row['depth_check_s_p50']:.3f} s); copies flagged {row['copies_flagged']}/{len(c)}, "
              f"rechecked {row['copies_rechecked']}/{row['copies_estimate_rechecked']}, relative "
              f"{min(row['copies_relative']):.2f}-{max(row['copies_relative']):.2f}, estimate "
              f"{min(row['copies_estimate']):.2f}-{max(row['copies_estimate']):.2f}; padders caught "
              f"{row['padders_caught']}/{len(d)}, relative {min(row['padders_relative']):.2f}-"
              f"{max(row['padders_relative']):.2f}, estimate {min(row['padders_estimate']):.2f}-"
              f"{max(row['padders_estimate']):.2f}")
        for k, f in row["files"].items():
            print(f"  {k}: flagged {f['flagged']}/{len(f['relative'])}, rechecked (estimate) "
                  f"{f['estimate_rechecked']}, relative {min(f['relative']):.2f}-{max(f['relative']):.2f}, "
                  f"estimate {min(f['estimate']):.2f}-{max(f['estimate']):.2f}")
    res["hardware"] = hardware(str(eng.device)).model_dump()
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
