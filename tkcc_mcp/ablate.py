"""`tkcc ablate`: a profile x trial grid of campaigns, and the table such studies report.

    tkcc ablate --profiles naive,expert,expert-window --trials 3 --agent anthropic --budget 20m --out runs/abl

Each cell (profile p, trial t) is a campaign in `DIR/cells/<p>/t<t>/` with agent ids
`t<t>.<agent>-<p>-<i>` and seed `seed + t`. Cells run one after another, trial by trial (all
profiles of trial 0, then of trial 1, ...), so drift of the machine spreads over profiles.
Without --engines each cell starts its own engine, so no cell sees another's candidates on
the leaderboard (independent trials); with --engines the cells share them (faster to start,
but agents can read earlier cells' candidates through `leaderboard`). Running again with the
same --out resumes: finished cells only rebuild their report, an interrupted one continues.

Per profile, the table reports: the best exact speedup after the budget (median and range
over trials; a trial with no exact gain counts 1.0x), the ensemble best after N trials (the
max), experiments per hour, the tool-call mix (shares of experiments / reading / logging) and
tokens spent per trial. Written to `DIR/ablation.md`, `DIR/ablation.json` and
`DIR/ablation_speedup.png`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

from tkcc_mcp.campaign import CampaignConfig, add_common, config_from_args, guarded, run_campaign, say
from tkcc_mcp.report import _fmt, expected_best_of, plot_timeline, table, tool_mix


def run_ablation(base: CampaignConfig, profiles: list[str], trials: int, out: Path) -> dict:
    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    cells, code = [], 0
    for t in range(trials):
        for p in profiles:
            if code:
                break
            name = Path(p).stem
            cfg = dataclasses.replace(base, profile=p, out=str(out / "cells" / name / f"t{t}"),
                                      seed=base.seed + t, id_prefix=f"t{t}.", print_summary=False)
            say(base, f"ablate: cell {name} trial {t} -> {cfg.out}")
            res = run_campaign(cfg)
            say(base, f"ablate: cell {name} trial {t}: {res['report']['verdict']}")
            cells.append({"profile": name, "trial": t, "out": cfg.out, "report": res["report"]})
            code = res["exit"]
    result = summarise(cells, profiles, trials, base)
    result["interrupted"] = bool(code)
    write(out, result, cells)
    print("\n".join(lines(result)), flush=True)
    print(f"\nablation: {out / 'ablation.md'} (and ablation.json, ablation_speedup.png)", flush=True)
    result["exit"] = code
    return result


def summarise(cells: list[dict], profiles: list[str], trials: int, base: CampaignConfig) -> dict:
    rows = {}
    for p in [Path(x).stem for x in profiles]:
        reps = [c["report"] for c in cells if c["profile"] == p]
        bests = [(r["best"]["fast"] if r["best"] and r["beats_reference"] else 1.0) for r in reps]
        fulls = [r["best"]["full"] for r in reps if r["best"] and r["best"]["full"] is not None]
        calls = []
        for r in reps:
            for a in r["agents"]:
                calls += [{"tool": t} for t, n in a["tool_calls"].items() for _ in range(n)]
        mix = tool_mix(calls)
        rows[p] = {
            "trials": len(reps),
            "best_per_trial": bests,
            "best_median": statistics.median(bests) if bests else None,
            "best_min": min(bests) if bests else None, "best_max": max(bests) if bests else None,
            "ensemble_best": max(bests) if bests else None,
            "expected_best_of_k": {k: round(expected_best_of(bests, k), 4) for k in range(1, len(bests) + 1)},
            "full_median": statistics.median(fulls) if fulls else None,
            "experiments_per_hour": statistics.mean(r["experiments_per_hour"] for r in reps) if reps else None,
            "experiments": sum(r["experiments"] for r in reps),
            "tokens_per_trial": statistics.mean(r["tokens"] for r in reps) if reps else None,
            "tool_mix": mix,
            "errors": sum(len(a["errors"]) for r in reps for a in r["agents"]),
        }
    return {"config": dataclasses.asdict(base), "profiles": rows, "trials": trials,
            "cells": [{k: v for k, v in c.items() if k != "report"} | {
                "best": c["report"]["best"], "verdict": c["report"]["verdict"]} for c in cells]}


def lines(result: dict) -> list[str]:
    cfg = result["config"]
    head = (f"ablation: agent {cfg['agent']}, {cfg['agents']} agent(s) per cell, budget {cfg['budget_s']:.0f} s, "
            f"{result['trials']} trial(s)")
    cols = ["profile", "best (median)", "range", f"ensemble of {result['trials']}", "full (median)", "exp/h",
            "experiments %", "reading %", "logging %", "tokens/trial", "errors"]
    rows = []
    for p, r in result["profiles"].items():
        c = r["tool_mix"]["categories"]
        rows.append([p, _fmt(r["best_median"]), f"{_fmt(r['best_min'])}-{_fmt(r['best_max'])}",
                     _fmt(r["ensemble_best"]), _fmt(r["full_median"]), _fmt(r["experiments_per_hour"], 1),
                     f"{c['experiments']:.0%}", f"{c['reading']:.0%}", f"{c['logging']:.0%}",
                     _fmt(r["tokens_per_trial"], 0), r["errors"]])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = lambda vals: "  ".join(str(v).ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return [head, "", fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def write(out: Path, result: dict, cells: list[dict]) -> None:
    (out / "ablation.json").write_text(json.dumps(result, indent=1, default=str))
    md = ["# tkcc ablation", "", "```", *lines(result), "```", "",
          "Best: the best exact fast-tier speedup of a trial after its budget (1.0 when no exact candidate beat "
          "the reference). Ensemble: the best over all trials of a profile. Shares are of all tool calls.", "",
          "## Cells", "",
          table([[c["profile"], c["trial"], c["best"]["candidate_id"] if c["best"] else None,
                  c["best"]["fast"] if c["best"] else None, c["verdict"], c["out"]] for c in result["cells"]],
                ["profile", "trial", "best candidate", "fast x", "verdict", "report"]), "",
          "![best speedup over time](ablation_speedup.png)", ""]
    (out / "ablation.md").write_text("\n".join(md))
    # one line per trial, grouped by profile (the right panel): best-so-far over campaign time
    tl = {"agents": {}, "profiles": {}}
    for c in cells:
        series = c["report"]["timeline"]["profiles"].get(c["profile"], [])
        tl["agents"][f"{c['profile']} t{c['trial']}"] = series
        prev = tl["profiles"].get(c["profile"])
        if not prev or (series and series[-1][1] > prev[-1][1]):
            tl["profiles"][c["profile"]] = series
    plot_timeline(tl, out / "ablation_speedup.png", budget_s=result["config"]["budget_s"],
                  panels=("trial", "profile (its best trial)"))


def add_parser(sub) -> None:
    p = sub.add_parser("ablate", help="a profile x trial grid of campaigns and the table studies report",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", required=True, help="comma-separated profile names or paths")
    p.add_argument("--trials", type=int, default=3, help="campaigns per profile (default 3)")
    add_common(p)


def main(args) -> int:
    os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")
    from engine_server.log import configure
    configure()  # loggers made at import read the level before it was set here
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]

    def go() -> int:
        if not profiles or args.trials < 1:
            raise ValueError(f"--profiles needs at least one profile and --trials at least 1 "
                             f"(got {args.profiles!r}, {args.trials})")
        from tkcc_mcp.agents.profiles import load_profile
        for name in profiles:  # every profile before the first campaign starts
            load_profile(name)
        return run_ablation(config_from_args(args), profiles, args.trials, Path(args.out))["exit"]
    return guarded(go)
