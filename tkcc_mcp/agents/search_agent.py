"""The offline search agent: hill-climbs on composed source rewrites (`moves.py`) through the
MCP tools, with no model and no API key.

    summary = await run_search(session, SearchConfig(index=0, deadline=...), resume)

It reads the engine source (the reference forward file names the family), then repeats one
experiment until its deadline or `max_experiments`:

    render a Spec -> submit_forward_pass(source, name=spec.name, parent=<best so far>)
                  -> check_bit_exact      (the gate: only bitwise-exact candidates go on)
                  -> measure_fast         (speedup over the reference, A/B in the same call)

and keeps the best exact candidate whose measurement is valid and faster than the best so
far (the reference, 1.0x, to start). `measure_full` confirms the best every
`confirm_every` experiments when it changed, and once more at the end. Proposals: agent 0
starts from every move that claims exactness, the others from random subsets; then one-move
neighbours of the best (additions of moves that claim exactness weigh more; moves whose
addition broke exactness are not tried again), random restarts when those run out. Spec
names are the plans' keys, so a resumed agent skips what it already tried. Every experiment
is a line in `search.log` in the agent's working directory.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from tkcc_mcp.agents import moves
from tkcc_mcp.agents.mcp_session import SessionClosed, ToolSession


@dataclass
class SearchConfig:
    index: int = 0  # agent number within the campaign: 0 starts from the exact bundle
    seed: int = 0
    device: str = "cpu"  # on CUDA, moves that sync with the host (no CUDA graphs) are left out
    max_experiments: int = 0  # total, resumed ones included; 0 = until the deadline
    deadline: float = math.inf  # time.monotonic() value
    confirm_every: int = 4


@dataclass
class Resume:
    """What an agent of the same id did before (the harness reads it from the ledger)."""
    experiments: int = 0
    tried: dict[str, str] = field(default_factory=dict)  # spec name -> failed | inexact | <speedup>
    best_id: str | None = None
    best_name: str | None = None
    best_speedup: float = 1.0
    full_measured: set[str] = field(default_factory=set)


@dataclass
class Best:
    cid: str
    spec: moves.Spec
    speedup: float


class SearchAgent:
    def __init__(self, session: ToolSession, cfg: SearchConfig, resume: Resume | None = None,
                 log_path: Path | None = None):
        self.s, self.cfg = session, cfg
        self.resume = resume or Resume()
        self.rng = random.Random(f"{cfg.seed}:{cfg.index}")
        self.experiments = self.resume.experiments
        self.tried = dict(self.resume.tried)
        self.full_measured = set(self.resume.full_measured)
        self.bad_moves: set[str] = set()
        self.best: Best | None = None
        self.base: moves.Spec | None = None
        self.sources: dict[str, str] = {}
        self.allowed: list[str] = []
        self.log_path = log_path
        self.since_confirm = 0

    # ---- plumbing -----------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(time.strftime("%H:%M:%S ") + msg + "\n")

    def time_left(self) -> float:
        return self.cfg.deadline - time.monotonic()

    def done(self) -> bool:
        if self.cfg.max_experiments and self.experiments >= self.cfg.max_experiments:
            return True
        return self.time_left() <= 0

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> dict:
        await self.read()
        if self.base is None:
            return self.summary("no-family")
        status = "done"
        while not self.done():
            spec = self.propose()
            if spec is None:
                status = "exhausted"
                break
            await self.experiment(spec)
            if self.best and self.best.cid not in self.full_measured and self.since_confirm >= self.cfg.confirm_every:
                await self.confirm()
        if self.best and self.best.cid not in self.full_measured and self.time_left() > 0:
            await self.confirm()
        return self.summary(status)

    async def read(self) -> None:
        """Read the listing, the reference forward pass (its file names the family) and the files
        the moves rewrite (common.py; llama.py for MoE): the candidates are rendered from them."""
        listing = await self.s.call("read_engine_source", {})
        ref = (listing.data or {}).get("reference_forward") or ""
        family = Path(ref).stem
        if family not in ("llama", "moe", "gpt2"):
            self.log(f"no moves for the reference {ref!r}: nothing to search")
            return
        self.sources = {}
        for path in moves.needed_files(family):
            text = await self.read_file(path)
            if text is None:
                self.log(f"could not read {path}: nothing to search")
                return
            self.sources[path] = text
        await self.s.call("traffic_profile", {})
        self.base = moves.Spec(family)
        self.allowed = moves.applicable(family, self.sources, self.cfg.device)
        self.log(f"family {family}; moves that apply: {', '.join(self.allowed) or 'none'}")
        r = self.resume
        if r.best_id and r.best_name and (parsed := moves.parse_name(r.best_name)) and parsed[0] == family:
            self.best = Best(r.best_id, moves.Spec(family, parsed[1]), r.best_speedup)
            self.log(f"resumed: {r.experiments} experiments, best {r.best_id} {r.best_speedup:.3f}x {r.best_name}")

    async def read_file(self, path: str) -> str | None:
        """A whole snapshot file through read_engine_source (it pages at 400 lines)."""
        parts, start = [], 1
        while True:
            r = await self.s.call("read_engine_source", {"path": path, "start_line": start})
            d = r.data or {}
            if not r.ok or not d.get("text") and d.get("total_lines", 1) != 0:
                return None
            parts.append(moves.strip_numbers(d.get("text") or ""))
            if not d.get("truncated"):
                return "\n".join(parts) + "\n"
            start = int(d["end_line"]) + 1

    async def experiment(self, spec: moves.Spec) -> None:
        self.experiments += 1
        self.since_confirm += 1
        parent = self.best.cid if self.best else "reference"
        try:
            source = moves.render(spec, self.sources)
        except moves.NotApplicable as e:
            self.tried[spec.name] = "not-applicable"
            self.experiments -= 1
            self.since_confirm -= 1
            self.log(f"{spec.name}: not applicable: {e}")
            return
        sub = await self.s.call("submit_forward_pass", {"source": source, "name": spec.name, "parent": parent})
        d = sub.data or {}
        cid = d.get("candidate_id")
        if not sub.ok or not d.get("ok"):
            err = d.get("error") or sub.error
            self.tried[spec.name] = "failed"
            self.log(f"{cid or '-'} {spec.name}: install failed: {err}")
            return
        ex = await self.s.call("check_bit_exact", {"candidate_id": cid})
        if not (ex.data or {}).get("exact"):
            self.tried[spec.name] = "inexact"
            self.blame(spec)
            e = ex.data or {}
            self.log(f"{cid} {spec.name}: not exact (max abs diff {e.get('max_abs_diff')}, "
                     f"violations {e.get('violations')}, error {e.get('error') or ex.error})")
            return
        m = await self.s.call("measure_fast", {"candidate_id": cid})
        md = m.data or {}
        speedup = float(md.get("speedup") or 0.0)
        valid = bool(m.ok and md.get("ok") and md.get("valid", False))
        self.tried[spec.name] = f"{speedup:.4f}" if valid else "invalid"
        better = valid and speedup > (self.best.speedup if self.best else 1.0)
        ci = md.get("speedup_ci95") or (0, 0)
        self.log(f"{cid} {spec.name}: exact, fast {speedup:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}]"
                 f"{' valid' if valid else ' INVALID ' + str(md.get('violations'))}{' -> best' if better else ''}")
        if better:
            self.best = Best(cid, spec, speedup)

    def blame(self, spec: moves.Spec) -> None:
        """A one-move step from the best that broke exactness: that move is not tried again."""
        base = self.best.spec.moves if self.best else frozenset()
        added = spec.moves - base
        if len(added) == 1:
            self.bad_moves |= added

    async def confirm(self) -> None:
        cid = self.best.cid
        m = await self.s.call("measure_full", {"candidate_id": cid})
        self.full_measured.add(cid)
        self.since_confirm = 0
        md = m.data or {}
        self.log(f"{cid} full tier: {md.get('speedup')} ci {md.get('speedup_ci95')} valid {md.get('valid')}")

    # ---- proposals ----------------------------------------------------------------------
    def propose(self) -> moves.Spec | None:
        avail = [m for m in self.allowed if m not in self.bad_moves]
        claimed = [m for m in avail if moves.MOVES[m].exact]
        if not avail:
            return None
        if self.best is None:
            if self.cfg.index == 0:
                spec = moves.apply(self.base, claimed)
                if spec.name not in self.tried:
                    return spec
            for _ in range(50):
                pick = [m for m in claimed if self.rng.random() < 0.6] or [self.rng.choice(claimed or avail)]
                spec = moves.apply(self.base, pick)
                if spec.name not in self.tried:
                    return spec
        cur = self.best.spec if self.best else self.base
        options, weights = [], []
        for label, step in moves.neighbours(cur, self.cfg.device, self.allowed):
            m = label[1:]
            if m in self.bad_moves and label[0] == "+":
                continue
            spec = step(cur)
            if spec.name in self.tried or spec == cur:
                continue
            options.append(spec)
            weights.append(3.0 if label[0] == "+" and moves.MOVES[m].exact else 1.0)
        if options:
            return self.rng.choices(options, weights)[0]
        for _ in range(100):  # every neighbour tried: a random restart two or three moves away
            spec = cur
            for _ in range(self.rng.choice((2, 3))):
                label, step = self.rng.choice(moves.neighbours(spec, self.cfg.device, avail))
                spec = step(spec)
            if spec.name not in self.tried and not (spec.moves & self.bad_moves):
                return spec
        return None

    def summary(self, status: str) -> dict:
        b = self.best
        return {"status": status, "experiments": self.experiments, "family": self.base and self.base.family,
                "best": None if b is None else {"candidate_id": b.cid, "name": b.spec.name, "speedup": b.speedup},
                "tried": len(self.tried), "bad_moves": sorted(self.bad_moves)}


async def run_search(session: ToolSession, cfg: SearchConfig, resume: Resume | None = None,
                     log_path: Path | None = None) -> dict:
    """Run the search until the deadline; returns a summary (status, experiments, best)."""
    agent = SearchAgent(session, cfg, resume, log_path)
    try:
        return await agent.run()
    except SessionClosed as e:
        agent.log(f"the MCP session closed: {e}")
        return agent.summary("session-closed")
