"""What the fast tier's depth check costs and what it catches, for several numbers of
rounds that time full depth: copies of the reference (must pass, their full-depth ratio
close to the reference's) and the depth padder of tests/cheaters (must be flagged),
interleaved in one engine so every setting sees the same machine; with --files, candidate
files too (correct passes: their ratios show how far a real pass's time departs from the
extrapolation's straight line; they must pass).

    python benchmarks/depth_check_bench.py --shrink --device cpu --n 30 --reps 5,3 3,3
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


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--n", type=int, default=20, help="reference copies per setting (padders: half as many)")
    p.add_argument("--reps", nargs="+", default=["5,3", "3,3"], help="decode,prefill least check rounds per setting")
    p.add_argument("--files", nargs="*", default=[], help="candidate files measured beside the copies (n each)")
    p.add_argument("--fast-fraction", type=float, default=None, help="the engine's fast_fraction (default its own)")
    a = p.parse_args()
    settings = [tuple(int(x) for x in r.split(",")) for r in a.reps]
    ff = {} if a.fast_fraction is None else {"fast_fraction": a.fast_fraction}
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device, **ff))
    kind = "cuda" if eng.cuda else "cpu"
    copy, pad = reference_source(eng), PADDER.read_text()
    files = {Path(f).stem: Path(f).read_text() for f in a.files}
    runs = {s: {"copy": [], "padder": [], **{k: [] for k in files}} for s in settings}
    for i in range(a.n * len(settings)):
        s = settings[i % len(settings)]
        measure.DEPTH_REPS[kind], measure.DEPTH_REPS_PREFILL[kind] = s
        jobs = [("copy", copy)] + ([("padder", pad)] if i // len(settings) % 2 == 0 else []) + list(files.items())
        for what, src in jobs:
            m = eng.measure_fast(eng.submit_forward_pass(src + f"\n# {what} {i}\n").candidate_id)
            runs[s][what].append({"valid": m.valid, "relative": round(relative(m), 3),
                                  "rechecked": any(v["rechecked"] for v in m.config["depth_check"].values()),
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
               "padders_caught": sum(not x["valid"] for x in d), "padders": len(d),
               "padders_relative": sorted(x["relative"] for x in d),
               "files": {k: {"flagged": sum(not x["valid"] for x in runs[s][k]),
                             "relative": sorted(x["relative"] for x in runs[s][k])} for k in files}}
        res["settings"].append(row)
        print(f"rounds {s[0]} decode, {s[1]} prefill: fast tier {row['fast_s_p50']:.3f} s a call "
              f"(depth check {row['depth_check_s_p50']:.3f} s); copies flagged {row['copies_flagged']}/{len(c)}, "
              f"rechecked {row['copies_rechecked']}, relative {min(row['copies_relative']):.2f}-"
              f"{max(row['copies_relative']):.2f}; padders caught {row['padders_caught']}/{len(d)}, "
              f"relative {min(row['padders_relative']):.2f}-{max(row['padders_relative']):.2f}")
        for k, f in row["files"].items():
            print(f"  {k}: flagged {f['flagged']}/{len(f['relative'])}, relative "
                  f"{min(f['relative']):.2f}-{max(f['relative']):.2f}")
    res["hardware"] = hardware(str(eng.device)).model_dump()
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
