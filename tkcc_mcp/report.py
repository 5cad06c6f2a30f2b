"""Campaign reports, from the ledger (what the engine measured) and the agents' records (what
the agents did: tokens, tool calls, errors).

    rep = build(out_dir, ledger, agents, state)     # a dict (report.json)
    write(out_dir, rep)                             # report.md, report.json, plots, best/

Contract: a candidate counts only if its latest finished `check_bit_exact` in the ledger says
exact and a `measure_fast` of it was valid (no violation); its speedup is the best such
measurement, never assumed. `full` is its latest valid `measure_full`. The best candidate is
the exact one with the highest fast-tier speedup; when none is above 1.0 the report says no
candidate beat the reference. Times are campaign time: seconds of budget spent, across
resumed runs (`state["sessions"]`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tkcc_mcp.agents.record import read_calls, read_record

EXPERIMENT_TOOLS = ("submit_forward_pass", "check_bit_exact", "measure_fast", "measure_full")
READING_TOOLS = ("read_engine_source", "candidate_source", "traffic_profile", "leaderboard")
LOGGING_TOOLS = ("notes_read", "notes_write", "Read", "Write", "Edit")


def category(tool: str) -> str:
    if tool in EXPERIMENT_TOOLS:
        return "experiments"
    if tool in READING_TOOLS:
        return "reading"
    if tool in LOGGING_TOOLS:
        return "logging"
    return "other"


# ---- the ledger's view ----------------------------------------------------------------------

def candidates(ledger, agent_ids: list[str] | None = None) -> dict[str, dict]:
    """Per candidate of these agents (all agents when None): install, exactness, fast and full
    speedups (valid measurements only), with the wall times they became known."""
    want = None if agent_ids is None else set(agent_ids)
    out: dict[str, dict] = {}
    for c in ledger.candidates():
        if want is not None and c.get("agent_id") not in want:
            continue
        out[c["id"]] = {"candidate_id": c["id"], "agent_id": c.get("agent_id"), "name": c.get("name"),
                        "parent": c.get("parent"), "created_at": c.get("created_at"), "installed": c.get("ok"),
                        "stage": c.get("stage"), "exact": None, "exact_at": None, "fast": None,
                        "fast_ci": None, "fast_at": None, "n_fast": 0, "full": None, "full_ci": None,
                        "full_at": None, "measures": []}
    for call in ledger.calls():
        c = out.get(call.get("candidate_id") or "")
        if c is None or call.get("finished_at") is None:
            continue
        r = call.get("result") if isinstance(call.get("result"), dict) else {}
        m, at = call["method"], call["finished_at"]
        if m == "check_bit_exact":
            c["exact"] = bool(call.get("ok") and r.get("ok") and r.get("exact"))
            c["exact_at"] = at
        elif m in ("measure_fast", "measure_full") and call.get("ok") and r.get("ok") and r.get("valid"):
            sp = r.get("speedup")
            if not isinstance(sp, (int, float)) or not math.isfinite(sp):
                continue
            ci = list(r.get("speedup_ci95") or (None, None))
            if m == "measure_fast":
                c["n_fast"] += 1
                c["measures"].append((at, float(sp)))
                if c["fast"] is None or sp > c["fast"]:
                    c["fast"], c["fast_ci"], c["fast_at"] = float(sp), ci, at
            else:
                c["full"], c["full_ci"], c["full_at"] = float(sp), ci, at
    return out


def exact_ranked(cands: dict[str, dict]) -> list[dict]:
    """Exact candidates with a valid fast-tier speedup, best first."""
    rows = [c for c in cands.values() if c["exact"] and c["fast"] is not None]
    return sorted(rows, key=lambda c: (-c["fast"], c["candidate_id"]))


def resume_state(ledger, agent_id: str, cands: dict[str, dict] | None = None) -> dict:
    """What an agent did before: experiments (its submissions), the spec names it tried and
    their outcomes, its best exact candidate above 1.0, and the candidates measured in full."""
    cands = candidates(ledger, [agent_id]) if cands is None else cands
    mine = [c for c in cands.values() if c["agent_id"] == agent_id]
    experiments = len(ledger.calls(agent_id=agent_id, method="submit_forward_pass"))
    tried = {}
    for c in mine:
        if not c["name"]:
            continue
        if not c["installed"]:
            tried[c["name"]] = "failed"
        elif c["exact"] is False:
            tried[c["name"]] = "inexact"
        else:
            tried[c["name"]] = "measured" if c["fast"] is None else f"{c['fast']:.4f}"
    best = next((c for c in exact_ranked({c["candidate_id"]: c for c in mine}) if c["fast"] > 1.0), None)
    return {"experiments": experiments, "tried": tried,
            "best_id": best and best["candidate_id"], "best_name": best and best["name"],
            "best_speedup": best["fast"] if best else 1.0,
            "full_measured": {c["candidate_id"] for c in mine if c["full"] is not None}}


# ---- campaign time ---------------------------------------------------------------------------

def campaign_time(wall: float, sessions: list[dict]) -> float:
    """Seconds of budget spent when wall-clock `wall` happened (sessions: started, offset_s)."""
    cur = None
    for s in sessions:
        if s["started"] <= wall:
            cur = s
    if cur is None:
        return 0.0
    return cur["offset_s"] + max(0.0, wall - cur["started"])


def timeline(cands: dict[str, dict], sessions: list[dict], key: str = "agent_id") -> dict[str, list]:
    """Per agent (or other key), the best exact fast speedup so far: [[t, speedup], ...]."""
    events: dict[str, list] = {}
    for c in cands.values():
        if not c["exact"]:
            continue
        for at, sp in c["measures"]:
            t = campaign_time(max(at, c["exact_at"] or at), sessions)
            events.setdefault(c[key] or "?", []).append((t, sp))
    out = {}
    for k, evs in events.items():
        best, pts = 0.0, []
        for t, sp in sorted(evs):
            if sp > best:
                best = sp
                pts.append([round(t, 2), round(sp, 4)])
        out[k] = pts
    return out


def expected_best_of(values: list[float], k: int) -> float:
    """E[max of k draws without replacement from values] (the best-of-k ensemble)."""
    v = sorted(values)
    n = len(v)
    if not 1 <= k <= n:
        return float("nan")
    return sum(v[i] * math.comb(i, k - 1) for i in range(n)) / math.comb(n, k)


def tool_mix(calls: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for c in calls:
        counts[c["tool"]] = counts.get(c["tool"], 0) + 1
    total = sum(counts.values())
    cats: dict[str, int] = {}
    for t, n in counts.items():
        cats[category(t)] = cats.get(category(t), 0) + n
    share = lambda n: round(n / total, 4) if total else 0.0  # noqa: E731
    return {"total": total, "counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            "shares": {t: share(n) for t, n in sorted(counts.items(), key=lambda kv: -kv[1])},
            "categories": {c: share(cats.get(c, 0)) for c in ("experiments", "reading", "logging", "other")}}


# ---- the report -----------------------------------------------------------------------------

def build(out: Path, ledger, agents: list[dict], state: dict, top: int = 5) -> dict:
    """`agents`: [{"agent_id", "kind", "profile", "workdir"}]. Returns the report dict."""
    out = Path(out)
    ids = [a["agent_id"] for a in agents]
    cands = candidates(ledger, ids)
    ranked = exact_ranked(cands)
    sessions = state.get("sessions") or []
    spent = float(state.get("spent_s") or 0.0)
    hours = max(spent, 1e-9) / 3600
    all_calls, rows = [], []
    for a in agents:
        rec = read_record(Path(a["workdir"])) or {}
        calls = read_calls(Path(a["workdir"]))
        all_calls += calls
        mine = [c for c in cands.values() if c["agent_id"] == a["agent_id"]]
        best = next((c for c in ranked if c["agent_id"] == a["agent_id"]), None)
        exps = len(ledger.calls(agent_id=a["agent_id"], method="submit_forward_pass"))
        rows.append({
            "agent_id": a["agent_id"], "kind": a["kind"], "profile": a["profile"],
            "context": rec.get("context"), "model": rec.get("model"), "status": rec.get("status"),
            "experiments": exps, "installed": sum(1 for c in mine if c["installed"]),
            "exact": sum(1 for c in mine if c["exact"]), "measured": sum(1 for c in mine if c["fast"] is not None),
            "best": brief(best), "experiments_per_hour": round(exps / hours, 1),
            "tokens": rec.get("tokens") or {}, "total_tokens": sum((rec.get("tokens") or {}).values()),
            "cost_usd": rec.get("cost_usd", 0.0), "turns": rec.get("turns", 0),
            "tool_calls": tool_mix(calls)["counts"], "tool_errors": rec.get("tool_errors", 0),
            "errors": rec.get("errors") or [], "notes": rec.get("notes") or [],
        })
    profiles = {}
    for p in sorted({a["profile"] for a in agents}):
        prow = [r for r in rows if r["profile"] == p]
        pcalls = [c for a in agents if a["profile"] == p for c in read_calls(Path(a["workdir"]))]
        bests = [r["best"]["fast"] for r in prow if r["best"]]
        profiles[p] = {"agents": len(prow), "experiments": sum(r["experiments"] for r in prow),
                       "experiments_per_hour": round(sum(r["experiments"] for r in prow) / hours, 1),
                       "best": max(bests) if bests else None,
                       "tokens": sum(r["total_tokens"] for r in prow), "tool_mix": tool_mix(pcalls)}
    best = ranked[0] if ranked else None
    per_agent = {r["agent_id"]: (r["best"]["fast"] if r["best"] else 1.0) for r in rows}
    vals = list(per_agent.values())
    for c in cands.values():
        c["profile"] = next((a["profile"] for a in agents if a["agent_id"] == c["agent_id"]), None)
    rep = {
        "out": str(out), "config": state.get("config", {}), "engine": state.get("engine", {}),
        "budget_s": state.get("config", {}).get("budget_s"), "spent_s": round(spent, 1),
        "runs": len(sessions), "interrupted": bool(state.get("interrupted")),
        "experiments": sum(r["experiments"] for r in rows),
        "experiments_per_hour": round(sum(r["experiments"] for r in rows) / hours, 1),
        "best": None if best is None else {**brief(best), "exact": True,
                                           "source_path": str(out / "best" / f"1_{best['candidate_id']}.py")},
        "beats_reference": bool(best and best["fast"] > 1.0),
        "leaderboard": [brief(c) for c in ranked[:20]],
        "agents": rows, "profiles": profiles, "tool_mix": tool_mix(all_calls),
        "tokens": sum(r["total_tokens"] for r in rows),
        "ensemble": {"n": len(vals), "best_of_n": max(vals) if vals else None, "per_agent_best": per_agent,
                     "expected_best_of_k": {k: round(expected_best_of(vals, k), 4) for k in range(1, len(vals) + 1)}},
        "timeline": {"agents": timeline(cands, sessions), "profiles": timeline(cands, sessions, "profile")},
    }
    rep["verdict"] = verdict(rep)
    rep["_top_sources"] = [(c["candidate_id"], ledger.candidate(c["candidate_id"])["source"]) for c in ranked[:top]]
    return rep


def brief(c: dict | None) -> dict | None:
    if c is None:
        return None
    return {"candidate_id": c["candidate_id"], "agent_id": c["agent_id"], "name": c["name"], "parent": c["parent"],
            "fast": round(c["fast"], 4) if c["fast"] is not None else None,
            "fast_ci": [round(x, 4) if isinstance(x, (int, float)) else x for x in (c["fast_ci"] or [])],
            "n_fast": c["n_fast"], "full": round(c["full"], 4) if c["full"] is not None else None,
            "full_ci": [round(x, 4) if isinstance(x, (int, float)) else x for x in (c["full_ci"] or [])]}


def verdict(rep: dict) -> str:
    b = rep["best"]
    if b is None:
        return "No candidate was both bitwise exact and validly measured: nothing beat the reference."
    ci = b["fast_ci"] or [None, None]
    full = f"; full tier {b['full']:.3f}x" if b["full"] is not None else "; not measured on the full tier"
    if not rep["beats_reference"]:
        return (f"No exact candidate beat the reference: the best, {b['candidate_id']} ({b['agent_id']}), "
                f"ran at {b['fast']:.3f}x on the fast tier{full}.")
    sure = ci[0] is not None and ci[0] > 1.0
    return (f"Best exact candidate {b['candidate_id']} ({b['agent_id']}): {b['fast']:.3f}x on the fast tier "
            f"(95% CI {ci[0]:.3f}-{ci[1]:.3f}{'' if sure else ', includes 1.0'}){full}.")


# ---- writing --------------------------------------------------------------------------------

def write(out: Path, rep: dict) -> dict:
    """report.json, report.md, speedup_over_time.png and best/<rank>_<cid>.py; returns the paths."""
    out = Path(out)
    best_dir = out / "best"
    best_dir.mkdir(parents=True, exist_ok=True)
    for old in best_dir.glob("*.py"):
        old.unlink()
    sources = rep.pop("_top_sources", [])
    for rank, (cid, src) in enumerate(sources, 1):
        (best_dir / f"{rank}_{cid}.py").write_text(src)
    plot = out / "speedup_over_time.png"
    plot_timeline(rep["timeline"], plot, budget_s=rep.get("budget_s"))
    rep["plots"] = [str(plot)]
    rep["best_sources"] = [str(best_dir / f"{r}_{cid}.py") for r, (cid, _) in enumerate(sources, 1)]
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "report.md").write_text(markdown(rep))
    return {"report_md": str(out / "report.md"), "report_json": str(out / "report.json"), "plot": str(plot),
            "best": rep["best_sources"]}


def plot_timeline(tl: dict, path: Path, budget_s: float | None = None, title: str = "",
                  panels: tuple[str, str] = ("agent", "profile")) -> None:
    """Best exact fast-tier speedup over campaign time: per agent (left), per profile (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (what, series) in zip(axes, ((panels[0], tl.get("agents", {})), (panels[1], tl.get("profiles", {})))):
        for name, pts in sorted(series.items()):
            end = max(budget_s or 0, pts[-1][0] if pts else 0)
            xs = [0.0] + [p[0] for p in pts] + [end]
            ys = [1.0] + [p[1] for p in pts] + [pts[-1][1] if pts else 1.0]
            ax.step(xs, ys, where="post", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("campaign time (s)")
        ax.set_title(f"best exact speedup per {what}")
        if series:
            ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fast-tier speedup over the reference")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd if abs(x) < 100 else 1}f}"
    return str(x)


def table(rows: list[list], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(rep: dict) -> str:
    cfg = rep.get("config", {})
    device = rep.get("engine", {}).get("device") or cfg.get("device") or "-"  # the engine's, as it ran
    L = [f"# tkcc campaign report: {Path(rep['out']).name}", "",
         f"**{rep['verdict']}**", "",
         f"- agent: `{cfg.get('agent')}`, profile: `{cfg.get('profile')}`, agents: {cfg.get('agents')}, "
         f"model: `{cfg.get('model')}`{' (shrunk)' if cfg.get('shrink') else ''}, device: `{device}`",
         f"- budget {_fmt(rep.get('budget_s'), 0)} s, spent {_fmt(rep['spent_s'], 1)} s over {rep['runs']} run(s)"
         f"{' (interrupted)' if rep.get('interrupted') else ''}; {rep['experiments']} experiments "
         f"({_fmt(rep['experiments_per_hour'], 1)} per hour); {rep['tokens']} tokens",
         f"- engine: {rep.get('engine', {}).get('urls')}; ledger `{rep.get('engine', {}).get('ledger')}`", ""]
    b = rep["best"]
    if b:
        L += ["## Best candidate", "",
              f"`{b['candidate_id']}` by `{b['agent_id']}` ({b['name']}), parent `{b['parent']}`: exact (bitwise, "
              f"from the ledger's check_bit_exact), fast tier {_fmt(b['fast'])}x "
              f"(95% CI {_fmt((b['fast_ci'] or [None])[0])}-{_fmt((b['fast_ci'] or [None, None])[1])}, "
              f"{b['n_fast']} measurement(s)), full tier {_fmt(b['full'])}x. Source: `{b['source_path']}`.", ""]
    L += ["## Leaderboard (exact candidates)", ""]
    if rep["leaderboard"]:
        L.append(table([[i + 1, c["candidate_id"], c["agent_id"], c["name"], c["fast"],
                         "-".join(_fmt(x) for x in c["fast_ci"]) if c["fast_ci"] else "-", c["full"]]
                        for i, c in enumerate(rep["leaderboard"][:10])],
                       ["#", "candidate", "agent", "name", "fast x", "fast 95% CI", "full x"]))
    else:
        L.append("No exact, measured candidate.")
    L += ["", "## Agents", "",
          table([[r["agent_id"], r["kind"], r["profile"], r["context"], r["status"], r["experiments"], r["exact"],
                  r["best"]["fast"] if r["best"] else None, r["experiments_per_hour"], r["total_tokens"],
                  sum(r["tool_calls"].values()), r["tool_errors"], len(r["errors"])] for r in rep["agents"]],
                ["agent", "kind", "profile", "context", "status", "experiments", "exact", "best x", "exp/h",
                 "tokens", "tool calls", "tool errors", "errors"]), "",
          "## Profiles", "",
          table([[p, d["agents"], d["experiments"], d["best"], d["experiments_per_hour"], d["tokens"],
                  d["tool_mix"]["categories"]["experiments"], d["tool_mix"]["categories"]["reading"],
                  d["tool_mix"]["categories"]["logging"]] for p, d in rep["profiles"].items()],
                ["profile", "agents", "experiments", "best x", "exp/h", "tokens", "experiments share",
                 "reading share", "logging share"]), "",
          "## Tool-call mix", ""]
    mix = rep["tool_mix"]
    L.append(table([[t, n, mix["shares"][t], category(t)] for t, n in mix["counts"].items()],
                    ["tool", "calls", "share", "category"]) if mix["counts"] else "No tool calls recorded.")
    cats = mix["categories"]
    L += ["", f"Reading {cats['reading']:.0%}, logging {cats['logging']:.0%}, experiments "
              f"{cats['experiments']:.0%}, other {cats['other']:.0%} of {mix['total']} calls.", "",
          "## Best-of-N ensemble", "",
          f"Best of {rep['ensemble']['n']} agents: {_fmt(rep['ensemble']['best_of_n'])}x (an agent with no exact "
          f"gain counts as the reference, 1.0x). Expected best of k agents: " +
          ", ".join(f"k={k}: {_fmt(v)}x" for k, v in rep["ensemble"]["expected_best_of_k"].items()) + ".", "",
          "## Speedup over time", "", "![speedup over time](speedup_over_time.png)", ""]
    errs = [(r["agent_id"], e) for r in rep["agents"] for e in r["errors"]]
    notes = [(r["agent_id"], n) for r in rep["agents"] for n in r["notes"]]
    if errs or notes:
        L += ["## Errors and notes", ""]
        L += [f"- `{a}` {e.get('kind')}: {str(e.get('message'))[:300]}" for a, e in errs[-20:]]
        L += [f"- `{a}` note: {n}" for a, n in notes]
        L.append("")
    return "\n".join(L)


def leaderboard_lines(rep: dict, n: int = 5) -> list[str]:
    """A few plain lines for the terminal."""
    out = [f"{'#':>2} {'candidate':9} {'agent':24} {'fast x':>7} {'95% CI':>15} {'full x':>7}  name"]
    for i, c in enumerate(rep["leaderboard"][:n], 1):
        ci = "-".join(_fmt(x) for x in c["fast_ci"]) if c["fast_ci"] else "-"
        out.append(f"{i:>2} {c['candidate_id']:9} {str(c['agent_id'])[:24]:24} {_fmt(c['fast']):>7} {ci:>15} "
                   f"{_fmt(c['full']):>7}  {str(c['name'])[:60]}")
    if not rep["leaderboard"]:
        out.append("   (no exact, measured candidate)")
    return out

