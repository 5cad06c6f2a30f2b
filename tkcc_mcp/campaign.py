"""`tkcc campaign`: N agents in parallel on one or several engines, a budget, a report.

    tkcc campaign --agent search --model llama-3.2-1b --shrink --device cpu --budget 60s --out runs/demo

Layout of `--out DIR`:
    DIR/campaign.json            config, engine, runs (sessions) and the budget spent so far
    DIR/engine/                  the engine's home when the campaign starts its own (no --engines):
                                 token, engine.json, engine.log, ledger.db (every experiment)
    DIR/agents/<id>/             each agent's working directory: record.json, calls.jsonl,
                                 mcp.log, search.log or transcript.jsonl, notes.md
    DIR/best/<rank>_<cid>.py     the best exact candidates' source
    DIR/report.md, report.json, speedup_over_time.png

Agent ids are `<prefix><agent>-<profile>-<i>`, the same on every run with the same
arguments, so running again with the same --out resumes: the engine in DIR/engine is
attached if it still runs (it is started detached) or started again on the same ledger; each
agent picks up its experiment count, tried plans and best candidate from the ledger; the
budget counts what earlier runs spent (saved every few seconds). Candidate ids come from the
ledger's counter and are never reused. SIGTERM/SIGINT stop the agents, write the report from
what the ledger holds, and stop the campaign's own engine (exit status 143/130).

Agent i uses engine i mod len(engines). Every agent kind drives its engine through its own
MCP session (`tkcc mcp --engine URL --agent-id ID`). After the agents, the harness measures
the best exact candidates on the full tier if they were not (`--confirm K`, as agent id
`<prefix>harness`), so the report's best is exact per the ledger and its speedups measured.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import json
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from engine_server.client import write_atomic
from tkcc_mcp import report
from tkcc_mcp.agents.mcp_session import EngineRef
from tkcc_mcp.agents.record import AgentRecord
from tkcc_mcp.report import leaderboard_lines

AGENT_KINDS = ("search", "claude", "anthropic")
DEFAULT_LLM_MODEL = "claude-sonnet-4-5"


@dataclass
class CampaignConfig:
    agent: str = "search"  # search | claude | anthropic
    profile: str = "expert"  # a name in agent_profiles/ or a path (the search agent only records it)
    agents: int = 1
    budget_s: float = 600.0
    max_experiments: int = 0  # per agent, resumed runs included; 0 = no limit
    model: str = "llama-3.2-1b"  # the engine's model (when the campaign starts its engine)
    shrink: bool | None = None  # default: on for presets on the CPU
    device: str = ""  # default: cuda if available, else cpu
    engines: list[str] = field(default_factory=list)  # URLs or engine homes; empty: start one in DIR/engine
    token_file: str = ""  # for --engines URLs (default $TKCC_HOME/engine.token)
    llm_model: str = DEFAULT_LLM_MODEL
    out: str = "runs/campaign"
    seed: int = 0
    id_prefix: str = ""
    confirm: int = 1  # measure_full the top K exact candidates that lack it
    keep_engine: bool = False
    progress_s: float = 5.0
    grace_s: float = 30.0  # after the deadline, before agents are cancelled
    engine_args: list[str] = field(default_factory=list)  # extra `tkcc engine start` flags
    quiet: bool = False
    print_summary: bool = True  # the verdict, leaderboard and paths on stdout at the end


def parse_duration(s: str | float) -> float:
    """'90', '90s', '10m', '1.5h' -> seconds."""
    if isinstance(s, (int, float)):
        return float(s)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(s))
    if not m:
        raise ValueError(f"bad duration {s!r}: use e.g. 90s, 10m, 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def agent_ids(cfg: CampaignConfig) -> list[str]:
    prof = Path(cfg.profile).stem if cfg.profile.endswith(".md") else cfg.profile
    return [f"{cfg.id_prefix}{cfg.agent}-{prof}-{i}" for i in range(cfg.agents)]


def say(cfg: CampaignConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, file=sys.stderr, flush=True)


# ---- state (campaign.json) ------------------------------------------------------------------

class State:
    def __init__(self, out: Path):
        self.path = out / "campaign.json"
        self.d: dict = {"sessions": [], "spent_s": 0.0}
        if self.path.exists():
            try:
                self.d = json.loads(self.path.read_text())
            except ValueError:
                pass  # torn write: the budget restarts from the last good value we cannot see

    @property
    def spent(self) -> float:
        return float(self.d.get("spent_s") or 0.0)

    def begin(self, config: dict, engine: dict) -> None:
        self.d["config"], self.d["engine"] = config, engine
        self.d.setdefault("sessions", []).append({"started": time.time(), "offset_s": self.spent, "ended": None})
        self.d["interrupted"] = False
        self.save()

    def tick(self) -> None:
        s = self.d["sessions"][-1]
        now = time.time()
        s["ended"] = now
        self.d["spent_s"] = s["offset_s"] + (now - s["started"])
        self.save()

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.d, indent=1, default=str))


# ---- engines --------------------------------------------------------------------------------

@dataclass
class Engines:
    refs: list[EngineRef]
    ledgers: list[str]
    owned_pid: int | None = None  # the engine this campaign started (stopped at the end)
    home: str | None = None
    device: str = "cpu"  # the (first) engine's device: the search leaves graph-breaking moves out on CUDA


def resolve_engines(cfg: CampaignConfig, out: Path) -> Engines:
    from engine_server.client import EngineClient, running_engine, state_dir
    from tkcc_mcp import launch

    if not cfg.engines:
        home = out / "engine"
        say(cfg, f"engine: attaching to or starting {cfg.model} in {home} ...")
        url, tf = launch.ensure_engine(home, model=cfg.model, shrink=cfg.shrink, device=cfg.device or None,
                                       extra_args=cfg.engine_args)
        info = running_engine(home) or {}
        dev = EngineClient.from_url(url, tf).call("info").get("engine", {}).get("config", {}).get("device")
        return Engines([EngineRef(url, str(tf))], [str(home / "ledger.db")], owned_pid=info.get("pid"),
                       home=str(home), device=dev or cfg.device or "cpu")
    refs, ledgers, device = [], [], None
    for e in cfg.engines:
        if Path(e).expanduser().is_dir():
            info = running_engine(Path(e).expanduser())
            if info is None:
                raise SystemExit(f"tkcc campaign: no running engine in {e}")
            ref = EngineRef(info["url"], str(info["token_file"]))
        else:
            ref = EngineRef(e, str(cfg.token_file or state_dir(None) / "engine.token"))
        info = EngineClient.from_url(ref.url, ref.token_file).call("info")
        if not info.get("ok"):
            raise SystemExit(f"tkcc campaign: engine {ref.url} did not answer info: {info}")
        refs.append(ref)
        ledgers.append(info["ledger"])
        device = device or info.get("engine", {}).get("config", {}).get("device")
    return Engines(refs, ledgers, device=device or cfg.device or "cpu")


class MultiLedger:
    """The ledgers of several engines as one (candidate ids qualified `e<k>/` when more than one)."""

    def __init__(self, paths: list[str]):
        from engine_server.ledger import Ledger
        self.ledgers = [Ledger(p) for p in paths]
        self.path = paths[0]

    def _q(self, k: int, cid):
        return cid if len(self.ledgers) == 1 or not cid else f"e{k}/{cid}"

    def _split(self, cid: str):
        if len(self.ledgers) == 1:
            return self.ledgers[0], cid
        k, _, c = cid.partition("/")
        return self.ledgers[int(k[1:])], c

    def candidates(self, agent_id=None, with_source=False):
        return [{**c, "id": self._q(k, c["id"]), "parent": self._q(k, c.get("parent"))}
                for k, led in enumerate(self.ledgers) for c in led.candidates(agent_id, with_source)]

    def calls(self, candidate_id=None, agent_id=None, method=None, limit=None):
        if candidate_id is not None:
            led, cid = self._split(candidate_id)
            return led.calls(cid, agent_id, method, limit)
        return [{**c, "candidate_id": self._q(k, c.get("candidate_id"))}
                for k, led in enumerate(self.ledgers) for c in led.calls(None, agent_id, method, limit)]

    def candidate(self, cid: str):
        led, c = self._split(cid)
        return led.candidate(c)

    def close(self):
        for led in self.ledgers:
            led.close()


# ---- agents ---------------------------------------------------------------------------------

@dataclass
class AgentSpec:
    agent_id: str
    index: int
    kind: str
    profile: str
    engine: EngineRef
    workdir: Path
    resume: dict

    def as_row(self) -> dict:
        return {"agent_id": self.agent_id, "kind": self.kind, "profile": self.profile, "workdir": str(self.workdir)}


async def run_agent(a: AgentSpec, cfg: CampaignConfig, deadline: float, rec: AgentRecord,
                    device: str = "cpu") -> dict:
    """Run one agent until its deadline (time.monotonic()); returns its summary."""
    if a.kind == "search":
        from tkcc_mcp.agents.mcp_session import ToolSession
        from tkcc_mcp.agents.search_agent import Resume, SearchConfig, run_search
        r = a.resume
        resume = Resume(r["experiments"], dict(r["tried"]), r["best_id"], r["best_name"], r["best_speedup"],
                        set(r["full_measured"]))
        sc = SearchConfig(index=a.index, seed=cfg.seed, device=device,
                          max_experiments=cfg.max_experiments, deadline=deadline)
        async with ToolSession(a.engine, a.agent_id, rec) as session:
            return await run_search(session, sc, resume, log_path=a.workdir / "search.log")
    from tkcc_mcp.agents.profiles import load_profile
    profile = load_profile(a.profile)
    task = dict(agent_id=a.agent_id, engine=a.engine, workdir=a.workdir, profile=profile, record=rec,
                deadline=deadline, max_experiments=cfg.max_experiments, resume=a.resume, model=cfg.llm_model)
    if a.kind == "claude":
        from tkcc_mcp.agents.claude_agent import run_claude_agent
        return await run_claude_agent(**task)
    if a.kind == "anthropic":
        from tkcc_mcp.agents.anthropic_agent import run_anthropic_agent
        return await run_anthropic_agent(**task)
    raise ValueError(f"unknown agent kind {a.kind!r}; kinds: {AGENT_KINDS}")


async def _agent_task(a: AgentSpec, cfg: CampaignConfig, deadline: float, results: dict, device: str) -> None:
    rec = AgentRecord.open(a.workdir, a.agent_id, a.kind, Path(a.profile).stem,
                           model="" if a.kind == "search" else cfg.llm_model)
    try:
        res = await run_agent(a, cfg, deadline, rec, device)
        results[a.agent_id] = res
        rec.finish(res.get("status", "done") if isinstance(res, dict) else "done")
    except anyio.get_cancelled_exc_class():
        rec.finish("stopped")
        raise
    except Exception as e:  # noqa: BLE001 - one agent's crash is recorded; the others carry on
        rec.error("crash", "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-8)))
        rec.finish("error")
        results[a.agent_id] = {"status": "error", "error": f"{type(e).__name__}: {e}"}


async def _run_agents(cfg: CampaignConfig, specs: list[AgentSpec], remaining: float, state: State,
                      ledger, device: str = "cpu") -> dict:
    deadline = time.monotonic() + remaining
    results: dict = {}
    stop = {"signal": None}

    async def watch_signals(scope):
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for s in sigs:
                stop["signal"] = s
                say(cfg, f"campaign: {signal.Signals(s).name}: stopping the agents and writing the report")
                scope.cancel()
                return

    async def progress():
        last, top = 0.0, None
        while True:
            await anyio.sleep(1.0)
            state.tick()
            if time.monotonic() - last >= cfg.progress_s:
                last = time.monotonic()
                line, ranked = progress_line(cfg, specs, state, ledger)
                say(cfg, line)
                head = [c["candidate_id"] for c in ranked[:3]]
                if head and head != top:  # the leaderboard changed at the top: show it
                    top = head
                    say(cfg, "\n".join("    " + ln for ln in leaderboard_lines(
                        {"leaderboard": [report.brief(c) for c in ranked]}, 3)))

    async with anyio.create_task_group() as outer:
        outer.start_soon(watch_signals, outer.cancel_scope)
        outer.start_soon(progress)
        with anyio.move_on_after(remaining + cfg.grace_s):
            async with anyio.create_task_group() as tg:
                for a in specs:
                    tg.start_soon(_agent_task, a, cfg, deadline, results, device)
        outer.cancel_scope.cancel()
    state.tick()
    return {"results": results, "signal": stop["signal"]}


def progress_line(cfg: CampaignConfig, specs: list[AgentSpec], state: State, ledger) -> tuple[str, list]:
    """One status line, and the exact candidates ranked (for the leaderboard under it)."""
    ids = [a.agent_id for a in specs]
    try:
        cands = report.candidates(ledger, ids)
    except Exception as e:  # noqa: BLE001 - a busy ledger: skip this line
        return f"[{state.spent:6.0f}/{cfg.budget_s:.0f}s] (ledger busy: {e})", []
    ranked = report.exact_ranked(cands)
    per = []
    for a in specs:
        n = sum(1 for c in cands.values() if c["agent_id"] == a.agent_id)
        b = next((c for c in ranked if c["agent_id"] == a.agent_id), None)
        per.append(f"{a.agent_id}: {n} cand" + (f", best {b['fast']:.3f}x" if b else ""))
    best = ranked[0] if ranked else None
    head = (f"best {best['fast']:.3f}x {best['candidate_id']} ({best['agent_id']})" if best
            else "no exact measured candidate yet")
    return f"[{state.spent:6.0f}/{cfg.budget_s:.0f}s] {len(cands)} candidates | {head} | " + "; ".join(per), ranked


# ---- the campaign ---------------------------------------------------------------------------

def confirm_best(cfg: CampaignConfig, engines: Engines, ledger, ids: list[str]) -> None:
    """measure_full the top `cfg.confirm` exact candidates that have no full-tier measurement."""
    from engine_server.client import EngineClient, EngineUnavailable
    if cfg.confirm <= 0:
        return
    ranked = report.exact_ranked(report.candidates(ledger, ids))
    for c in ranked[:cfg.confirm]:
        if c["full"] is not None:
            continue
        k, cid = (0, c["candidate_id"]) if len(engines.refs) == 1 else (
            int(c["candidate_id"].split("/")[0][1:]), c["candidate_id"].split("/")[1])
        ref = engines.refs[k]
        say(cfg, f"campaign: confirming {c['candidate_id']} ({c['fast']:.3f}x fast) on the full tier ...")
        try:
            r = EngineClient.from_url(ref.url, ref.token_file, agent_id=f"{cfg.id_prefix}harness").call(
                "measure_full", candidate_id=cid)
            say(cfg, f"campaign: {c['candidate_id']} full tier {r.get('speedup')} valid {r.get('valid')}")
        except EngineUnavailable as e:
            say(cfg, f"campaign: could not confirm {c['candidate_id']}: {e}")


def check(cfg: CampaignConfig) -> None:
    """Refuse, before anything starts, a campaign that could not run as asked (ValueError)."""
    from tkcc_mcp.agents.profiles import load_profile
    from tkcc_mcp.agents.record import missing_credentials
    if cfg.agent not in AGENT_KINDS:
        raise ValueError(f"--agent must be one of {AGENT_KINDS}")
    if cfg.budget_s <= 0 or cfg.agents < 1 or cfg.max_experiments < 0:
        raise ValueError(f"--budget must be above 0 s, --agents at least 1 and --max-experiments 0 (no cap) or more "
                         f"(got {cfg.budget_s:g} s, {cfg.agents}, {cfg.max_experiments})")
    load_profile(cfg.profile)  # every agent's profile, the search agent's label too: fail now, not per agent
    if cfg.agent != "search" and missing_credentials():
        raise ValueError(f"the {cfg.agent} agent cannot call a model: {missing_credentials()}")
    if cfg.engines:
        ignored = [flag for flag, v, default in (("--model", cfg.model, CampaignConfig.model), ("--device", cfg.device, ""),
                                                 ("--shrink", cfg.shrink, None), ("--engine-arg", cfg.engine_args, []),
                                                 ("--keep-engine", cfg.keep_engine, False)) if v != default]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} set the engine a campaign starts; with --engines the engines "
                             f"are already running: leave {'it' if len(ignored) == 1 else 'them'} out")
    else:  # the engine this campaign starts: its model and device, checked here
        from engine_server.config import check_device, resolve_model
        from tkcc_mcp.launch import default_device
        resolve_model(cfg.model)
        check_device(cfg.device or default_device())


def _same_campaign(cfg: CampaignConfig, out: Path) -> None:
    """A campaign resumed in `out` runs on the model, device and agents it started with."""
    try:
        before = json.loads((out / "campaign.json").read_text()).get("config") or {}
    except (OSError, ValueError):
        return
    keys = ("agent", "profile", "model", "shrink", "device") if not cfg.engines else ("agent", "profile")
    now = dataclasses.asdict(cfg)
    diff = [f"{k} {before[k]!r} -> {now[k]!r}" for k in keys if k in before and before[k] != now[k]]
    if diff:
        raise ValueError(f"{out} holds a campaign with other settings ({'; '.join(diff)}): resume it with its "
                         f"own, or give another --out")


def _own_ids(cfg: CampaignConfig, out: Path, state: State, ledgers: list[str]) -> tuple[CampaignConfig, list[str]]:
    """Agent ids on shared engines: a campaign resumed in `out` keeps the ids it began with; a new
    one whose ids another campaign already used on these engines takes `out`'s name as a prefix,
    so it neither resumes nor counts that campaign's experiments."""
    from engine_server.ledger import Ledger
    if state.d.get("config"):
        cfg = dataclasses.replace(cfg, id_prefix=state.d["config"].get("id_prefix", cfg.id_prefix))
    elif any(Ledger(ledgers[i % len(ledgers)]).calls(agent_id=aid, limit=1) for i, aid in enumerate(agent_ids(cfg))):
        cfg = dataclasses.replace(cfg, id_prefix=f"{out.name}.{cfg.id_prefix}")
        say(cfg, f"campaign: these engines have run agents {agent_ids(cfg)[0].removeprefix(out.name + '.')}... "
                 f"before; this campaign's are {', '.join(agent_ids(cfg))}")
    return cfg, agent_ids(cfg)


def run_campaign(cfg: CampaignConfig) -> dict:
    """Run (or resume) a campaign; returns {"report": ..., "paths": ..., "exit": code}."""
    from engine_server.ledger import Ledger
    from tkcc_mcp import launch

    check(cfg)
    out = Path(cfg.out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    _same_campaign(cfg, out)
    (out / "agents").mkdir(parents=True, exist_ok=True)
    lock = open(out / "campaign.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel drops it if we die
    except BlockingIOError:
        raise SystemExit(f"tkcc campaign: another campaign is running on {out}") from None
    state = State(out)
    ids = agent_ids(cfg)
    remaining = cfg.budget_s - state.spent
    old = signal.signal(signal.SIGTERM, _terminate)  # a SIGTERM while starting still stops our engine
    engines = Engines([], [])
    try:
        if cfg.engines:
            engines = resolve_engines(cfg, out)
            ledgers = engines.ledgers
            cfg, ids = _own_ids(cfg, out, state, ledgers)
        else:  # our own engine's ledger: readable before (or without) the engine
            (out / "engine").mkdir(exist_ok=True)
            ledgers = [str(out / "engine" / "ledger.db")]
        resumes = [report.resume_state(Ledger(ledgers[i % len(ledgers)]), aid) for i, aid in enumerate(ids)]
        capped = bool(cfg.max_experiments) and all(r["experiments"] >= cfg.max_experiments for r in resumes)
        if any(r["experiments"] for r in resumes):
            say(cfg, "campaign: resuming: " + ", ".join(f"{aid} {r['experiments']} experiments"
                                                       for aid, r in zip(ids, resumes)) + f"; {state.spent:.0f} s spent")
        run = {"results": {}, "signal": None}
        if remaining <= 0 or capped:
            say(cfg, "campaign: budget or experiment cap already reached; rebuilding the report")
        elif not cfg.engines:
            engines = resolve_engines(cfg, out)
        specs = [AgentSpec(aid, i, cfg.agent, cfg.profile, engines.refs[i % len(engines.refs)] if engines.refs
                           else None, out / "agents" / aid, r) for i, (aid, r) in enumerate(zip(ids, resumes))]
        state.begin(dataclasses.asdict(cfg) | {"agent_ids": ids},
                    {"urls": [r.url for r in engines.refs], "device": engines.device if engines.refs else None,
                     "ledger": ledgers[0] if len(ledgers) == 1 else ledgers,
                     "home": engines.home or (str(out / "engine") if not cfg.engines else None)})
        ledger = MultiLedger(ledgers)
        if engines.refs and not (remaining <= 0 or capped):
            say(cfg, f"campaign: {len(specs)} {cfg.agent} agent(s), {remaining:.0f} s left of {cfg.budget_s:.0f} s; "
                     f"out {out}")
            run = anyio.run(_run_agents, cfg, specs, remaining, state, ledger, engines.device)
            if run["signal"] is not None:
                state.d["interrupted"] = True
                state.save()
            else:
                confirm_best(cfg, engines, ledger, ids)
        rep = report.build(out, ledger, [a.as_row() for a in specs], state.d)
        paths = report.write(out, rep)
        ledger.close()
        if cfg.print_summary:
            print_summary(rep, paths)
        code = 128 + int(run["signal"]) if run["signal"] is not None else 0
        return {"report": rep, "paths": paths, "exit": code, "results": run["results"]}
    finally:
        signal.signal(signal.SIGTERM, old)
        if engines.owned_pid and not cfg.keep_engine:
            launch.stop_engine(engines.owned_pid)
        lock.close()


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


STATUS_WORDS = {"exhausted": "tried every combination of its moves", "done": "ran to the budget or its limit",
                "no-family": "found no model family it knows", "error": "failed (see report.md)"}


def stop_line(rep: dict) -> str:
    """How the agents ended, and whether the campaign ended before its budget because they all had."""
    counts = collections.Counter(r.get("status") or "unknown" for r in rep["agents"])
    said = "; ".join(f"{n} {s} ({STATUS_WORDS[s]})" if s in STATUS_WORDS else f"{n} {s}" for s, n in counts.items())
    budget = rep.get("budget_s") or 0
    early = budget and rep["spent_s"] < 0.95 * budget and not rep.get("interrupted")
    return f"agents: {said}" + (f"; every agent stopped before the {budget:.0f} s budget" if early else "")


def print_summary(rep: dict, paths: dict) -> None:
    lines = ["", rep["verdict"], ""] + leaderboard_lines(rep) + [
        "", f"experiments: {rep['experiments']} ({rep['experiments_per_hour']:.0f}/h), spent {rep['spent_s']:.0f} s",
        stop_line(rep),
        f"report: {paths['report_md']} (and report.json)", f"plot:   {paths['plot']}",
        f"best:   {paths['best'][0] if paths['best'] else '(none)'}", f"ledger: {rep['engine'].get('ledger')}"]
    print("\n".join(lines), flush=True)


# ---- command line ---------------------------------------------------------------------------

def add_common(p) -> None:
    """Flags `campaign` and `ablate` share (one-to-one with CampaignConfig's fields)."""
    import argparse
    p.add_argument("--agent", choices=AGENT_KINDS, default="search",
                   help="search: offline, no model; claude: Claude Code via the Agent SDK; anthropic: our loop (default search)")
    p.add_argument("--agents", type=int, default=1, help="agents in parallel (per campaign; default 1)")
    p.add_argument("--budget", default="10m", help="wall-clock budget of the agents, e.g. 60s, 10m, 1h (default 10m)")
    p.add_argument("--max-experiments", type=int, default=0, help="per agent (default 0: until the budget)")
    p.add_argument("--model", default="llama-3.2-1b", help="the engine's model (preset, config.json or HF dir; default llama-3.2-1b)")
    p.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU-sized copy of the model (default: on for presets on the CPU)")
    p.add_argument("--device", default="", help="engine device (default: cuda if available, else cpu)")
    p.add_argument("--engines", default="", help="comma-separated engine URLs or homes to use instead of "
                                                 "starting one (one per GPU; agent i uses engine i mod n)")
    p.add_argument("--token-file", default="", help="token of the --engines URLs (default $TKCC_HOME/engine.token)")
    p.add_argument("--llm-model", default=DEFAULT_LLM_MODEL, help=f"model of the claude/anthropic agents (default {DEFAULT_LLM_MODEL})")
    p.add_argument("--out", required=True, help="output directory (running again with it resumes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search agents' moves (default 0)")
    p.add_argument("--confirm", type=int, default=1, help="measure_full the top K exact candidates at the end (default 1)")
    p.add_argument("--keep-engine", action="store_true", help="leave the campaign's own engine running")
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="extra `tkcc engine start` flag for the engine it starts, e.g. --engine-arg=--fast-rounds=9")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def config_from_args(args, **over) -> CampaignConfig:
    return CampaignConfig(
        agent=args.agent, profile=getattr(args, "profile", "expert"), agents=args.agents,
        budget_s=parse_duration(args.budget), max_experiments=args.max_experiments, model=args.model,
        shrink=args.shrink, device=args.device, engines=[e for e in args.engines.split(",") if e],
        token_file=args.token_file, llm_model=args.llm_model, out=args.out, seed=args.seed,
        confirm=args.confirm, keep_engine=args.keep_engine, engine_args=list(args.engine_arg),
        quiet=args.quiet, **over)


def add_parser(sub) -> None:
    p = sub.add_parser("campaign", help="run N agents in parallel against engines; report and plots",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="expert", help="agent profile: a name in agent_profiles/ or a .md path (default expert)")
    add_common(p)


def main(args) -> int:
    os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")
    from engine_server.log import configure
    configure()  # loggers made at import read the level before it was set here
    return guarded(lambda: run_campaign(config_from_args(args))["exit"])


def guarded(fn) -> int:
    """Expected failures as one line on stderr and an exit status, not a traceback."""
    from engine_server.client import EngineUnavailable
    from tkcc_mcp.agents.profiles import ProfileError
    from tkcc_mcp.launch import EngineStartError
    try:
        return fn()
    except (EngineStartError, EngineUnavailable, ProfileError, ValueError) as e:
        print(f"tkcc: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tkcc: interrupted before the agents started", file=sys.stderr)
        return 130
