"""The continual loop: watch serving traffic, recompile on drift, promote, canary, roll back.

    tkcc serve --model llama-3.2-1b --shrink --device cpu --port 8000 --continual \\
        --window-requests 64 --campaign-budget-s 300

Every `check_every_s` the loop profiles the last `window_requests` requests of the serving
log (`engine_server.drift`) and compares them with the profile the serving forward pass was
tuned on (at start: the engine's traffic file; after a recompilation: the window it was
recompiled for). On drift:

1. the window is written as a serving log, `<workdir>/rNNN/window.jsonl`;
2. a separate engine is started on it (`tkcc engine start --traffic window.jsonl`, same
   model, seed, dtype, batch and cache size as the serving engine) and a campaign (offline
   search agent by default) runs against it as a subprocess (`tkcc campaign --engines URL`;
   its report in `rNNN/campaign/report.json`);
3. the campaign's best exact candidate must pass, on that engine: `check_bit_exact`
   (bitwise), and `measure_full` on the window's traffic whose 95% interval, divided by the
   serving pass's own full-tier speedup measured there too, clears `1 + min_full_gain`;
4. a winner is promoted by hot swap into the serving engine (`Service.promote`: between two
   scheduler steps, no request fails or is dropped);
5. a canary compares the live decode step time of the new pass with the previous pass's
   recent steps, batch size by batch size; a regression beyond `canary_tolerance` rolls
   back to the previous pass.

Every decision is a ledger event (the serving home's ledger) with its evidence:
`continual_start`, `drift_detected` (distances, thresholds, the window file),
`campaign_started`, `campaign_finished` (report summary), `candidate_rejected` (reason),
`promoted`, `canary` (verdict, ratio, step counts), `rolled_back`, `retuned` (the profile
the serving pass now counts as tuned on), `continual_error` (the loop's own failure; it
carries on). `promote_with_canary` is also callable directly (a planted candidate, a
hand-written one): it goes through steps 4-5 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from engine_server import drift as D
from engine_server.log import get_logger

log = get_logger("continual")
AGENT = "continual"


@dataclass
class ContinualConfig:
    """`tkcc serve --continual` flags (underscores become dashes)."""
    window_requests: int = 64  # the live window: the last N finished requests
    check_every_s: float = 10.0
    cooldown_s: float = 30.0  # after a recompilation, before the next check
    campaign_agent: str = "search"  # search | claude | anthropic
    campaign_agents: int = 1
    campaign_budget_s: float = 300.0
    campaign_max_experiments: int = 0  # per agent; 0: until the budget
    campaign_engine_args: str = ""  # more `tkcc engine start` flags for the campaign's engine
    campaign_timeout_s: float = 0.0  # 0: budget + 300 s
    min_full_gain: float = 0.0  # lower end of the winner's full-tier 95% CI / serving pass's must be >= 1 + this
    canary_min_steps: int = 30  # decode steps of the new pass before a verdict
    canary_max_s: float = 120.0  # after this, fewer steps give "inconclusive" (the pass stays)
    canary_tolerance: float = 0.15  # roll back when decode steps are slower by more than this share
    baseline_steps: int = 256  # the previous pass's most recent decode steps the canary compares with
    workdir: str = ""  # default <home>/continual

    def __post_init__(self):
        from tkcc_mcp.campaign import AGENT_KINDS
        if self.campaign_agent not in AGENT_KINDS:  # it reaches `tkcc campaign` only at the first drift
            raise ValueError(f"--campaign-agent {self.campaign_agent!r}: one of {AGENT_KINDS}")


# ---- pure decisions ------------------------------------------------------------------------------

def judge(exact: dict, full: dict, serving_speedup: float, min_full_gain: float) -> tuple[bool, str]:
    """Whether a campaign's winner may be promoted, and why (or why not)."""
    if not exact.get("ok") or not exact.get("exact"):
        why = exact.get("first_mismatch") or exact.get("error") or exact.get("violations")
        return False, f"not bitwise exact ({why})"
    if not full.get("ok") or not full.get("valid"):
        return False, f"full tier not valid ({full.get('error') or full.get('violations')})"
    lo = (full.get("speedup_ci95") or [full.get("speedup") or 0.0])[0]
    gain = lo / serving_speedup
    if gain < 1 + min_full_gain:
        return False, (f"does not beat the serving pass on the full tier: 95% CI low {lo:.3f}x over the serving "
                       f"pass's {serving_speedup:.3f}x = {gain:.3f}, needs >= {1 + min_full_gain:.3f}")
    return True, (f"clears the bar: full-tier 95% CI low {lo:.3f}x over the serving pass's {serving_speedup:.3f}x "
                  f"= {gain:.3f} >= {1 + min_full_gain:.3f}")


def compare_steps(old: list, new: list, tolerance: float, min_steps: int) -> dict:
    """Canary verdict from decode step records (`StepRecord`: rows, seconds) of the previous
    pass (`old`) and the new one. Each new step is divided by what the previous pass took at
    its batch size: the median of its steps with that many rows (sizes with 3+ steps),
    interpolated linearly between those sizes, clamped below the smallest, extrapolated
    above the largest along the last segment (at most in proportion to rows). Step time is affine or concave
    in rows, so both ends flatter the new pass: a batch-mix change raises no false alarm.
    The verdict ratio is the median of those quotients: `regressed` above 1 + tolerance,
    `inconclusive` with too few steps."""
    res = {"new_steps": len(new), "old_steps": len(old), "tolerance": tolerance}
    if len(new) < min_steps or len(old) < 3:
        return res | {"verdict": "inconclusive", "ratio": None,
                      "reason": f"{len(new)} new / {len(old)} old decode steps (need {min_steps} / 3)"}
    groups: dict[int, list[float]] = {}
    for s in old:
        groups.setdefault(s.rows, []).append(s.seconds)
    solid = {r: ts for r, ts in groups.items() if len(ts) >= 3}  # a lone step's time is noise
    pts = sorted((r, statistics.median(ts)) for r, ts in (solid or groups).items())

    def expected(rows: int) -> float:
        if rows <= pts[0][0]:
            return pts[0][1]
        if rows >= pts[-1][0]:
            (r0, t0), (r1, t1) = pts[-2] if len(pts) > 1 else (0, 0.0), pts[-1]
            along = t1 + max(0.0, (t1 - t0) / (r1 - r0)) * (rows - r1) if len(pts) > 1 else float("inf")
            return min(along, t1 * rows / r1)
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if r0 <= rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        raise AssertionError("unreachable")
    ratio = statistics.median(s.seconds / expected(s.rows) for s in new)
    return res | {"verdict": "regressed" if ratio > 1 + tolerance else "pass", "ratio": round(ratio, 4),
                  "new_median_ms": round(statistics.median(s.seconds for s in new) * 1e3, 4),
                  "old_median_ms": round(statistics.median(s.seconds for s in old) * 1e3, 4),
                  "new_rows_mean": round(statistics.mean(s.rows for s in new), 2),
                  "old_rows_mean": round(statistics.mean(s.rows for s in old), 2)}


# ---- the loop ------------------------------------------------------------------------------------

class Continual:
    def __init__(self, service, config: ContinualConfig | None = None, drift_config: D.DriftConfig | None = None):
        self.service, self.cfg = service, config or ContinualConfig()
        self.drift_cfg = drift_config or D.DriftConfig()
        self.ledger = service.ledger
        self.workdir = Path(self.cfg.workdir or service.home / "continual")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tuned = D.profile_file(service.engine.config.traffic)
        self.decisions: list[dict] = []  # the events of this process, in order (also in the ledger)
        self.rounds = 0
        self.status = "watching"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._procs: list[subprocess.Popen] = []
        self._next_check = 0.0
        self._promoting = threading.Lock()  # one promotion and canary at a time
        self.event("continual_start", {"tuned_on": self.tuned.source, "config": dataclasses.asdict(self.cfg),
                                       "drift": dataclasses.asdict(self.drift_cfg)})

    def event(self, kind: str, data: dict, candidate_id: str | None = None) -> None:
        self.ledger.record_event(kind, data, candidate_id=candidate_id, agent_id=AGENT)
        self.decisions.append({"kind": kind, "candidate_id": candidate_id, **data})
        log.info(kind, candidate=candidate_id, **{k: v for k, v in data.items() if isinstance(v, (str, int, float))})

    # -- thread --

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tkcc-continual", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        for p in list(self._procs):
            _kill(p)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def run(self) -> None:
        while not self._stop.wait(self.cfg.check_every_s):
            if time.monotonic() < self._next_check:
                continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the loop's failure is an event; serving goes on
                if self._stop.is_set():
                    return
                self.event("continual_error", {"error": f"{type(e).__name__}: {e}",
                                               "traceback": traceback.format_exc()[-3000:]})
                self._next_check = time.monotonic() + self.cfg.cooldown_s
            finally:
                self.status = "watching"

    def check(self) -> tuple[D.Drift | None, list[dict], D.Profile | None]:
        """Drift of the live window against the tuned profile (None: too few requests yet)."""
        window = self.service.log.window(self.cfg.window_requests)
        if len(window) < max(2, self.drift_cfg.min_requests):
            return None, window, None
        live = D.profile_records(window, f"live window ({len(window)} requests)")
        if self.tuned.experts is None and live.experts is not None:
            # the tuned-on trace has no routing: the first window's is the baseline
            self.tuned = self.tuned.model_copy(update={"experts": live.experts, "expert_tokens": live.expert_tokens})
        return D.drift(self.tuned, live, self.drift_cfg), window, live

    def step(self) -> dict | None:
        """One check; on drift, one recompilation. Returns the recompilation's outcome."""
        d, window, live = self.check()
        if d is None or not d.drifted:
            return None
        return self.recompile(window, live, d)

    # -- recompilation --

    def recompile(self, window: list[dict], live: D.Profile, d: D.Drift) -> dict:
        self.rounds += 1
        self.status = "recompiling"
        rdir = self.workdir / f"r{self.rounds:03d}"
        rdir.mkdir(parents=True, exist_ok=True)
        wfile = rdir / "window.jsonl"
        wfile.write_text("".join(json.dumps(r) + "\n" for r in sorted(window, key=lambda r: r["arrival_s"])))
        self.event("drift_detected", {"round": self.rounds, "window": str(wfile), "tuned_on": self.tuned.source,
                                      "distances": d.model_dump(), "serving": self.service.active})
        try:
            outcome = self._campaign_and_promote(rdir, wfile)
        finally:
            self.tuned = live.model_copy(update={"source": str(wfile)})
            self.event("retuned", {"round": self.rounds, "tuned_on": str(wfile), "serving": self.service.active})
            self._next_check = time.monotonic() + self.cfg.cooldown_s
        return outcome

    def _engine_args(self, wfile: Path) -> list[str]:
        c = self.service.engine.config
        return ["--traffic", str(wfile), "--seed", str(c.seed), "--dtype", c.dtype, "--max-batch", str(c.max_batch),
                "--max-seq", str(c.max_seq), "--cpu-threads", str(c.cpu_threads),
                *shlex.split(self.cfg.campaign_engine_args)]

    def _campaign_and_promote(self, rdir: Path, wfile: Path) -> dict:
        from engine_server.client import EngineClient
        from tkcc_mcp import launch
        c, cfg = self.service.engine.config, self.cfg
        proc, info = launch.start_engine(rdir / "engine", c.model, c.shrink, c.device, self._engine_args(wfile))
        self._procs.append(proc)
        try:
            out = rdir / "campaign"
            cmd = [sys.executable, "-m", "tkcc_mcp.cli", "campaign", "--agent", cfg.campaign_agent,
                   "--agents", str(cfg.campaign_agents), "--budget", f"{cfg.campaign_budget_s:g}s",
                   "--max-experiments", str(cfg.campaign_max_experiments), "--engines", info["url"],
                   "--token-file", str(info["token_file"]), "--out", str(out), "--confirm", "0",
                   "--seed", str(self.rounds), "--quiet"]
            self.event("campaign_started", {"round": self.rounds, "out": str(out), "engine": info["url"],
                                            "engine_ledger": info.get("ledger"), "command": shlex.join(cmd)})
            t0 = time.monotonic()
            rc, rep = self._run_campaign(cmd, out)
            best = (rep or {}).get("best")
            secs = round(time.monotonic() - t0, 2)
            self.event("campaign_finished", {"round": self.rounds, "exit": rc, "seconds": secs,
                                             "experiments": (rep or {}).get("experiments"), "best": best,
                                             "verdict": (rep or {}).get("verdict"), "report": str(out / "report.json")})
            if self._stop.is_set():
                return {"ok": False, "reason": "stopped"}
            if not best:
                reason = "the campaign found no exact candidate with a valid measurement"
                self.event("candidate_rejected", {"round": self.rounds, "reason": reason})
                return {"ok": False, "reason": reason}
            client = EngineClient.from_url(info["url"], info["token_file"], agent_id=AGENT)
            evidence = self._verify(client, best["candidate_id"])
            if not evidence["ok"]:
                self.event("candidate_rejected", {"round": self.rounds, **evidence})
                return evidence
            src = client.call("candidate_source", candidate_id=best["candidate_id"])["source"]
            name = f"{best.get('name') or best['candidate_id']} (round {self.rounds})"
            return self.promote_with_canary(src, name, {"round": self.rounds, **evidence})
        finally:
            launch.stop_engine(info["pid"])
            self._procs.remove(proc)

    def _run_campaign(self, cmd: list[str], out: Path) -> tuple[int, dict | None]:
        out.mkdir(parents=True, exist_ok=True)
        timeout = self.cfg.campaign_timeout_s or self.cfg.campaign_budget_s + 300
        with open(out / "campaign.log", "ab") as logf:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                                 env=os.environ | {"TKCC_LOG_LEVEL": "WARNING"})
        self._procs.append(p)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(p)
            rc = -9
        finally:
            self._procs.remove(p)
        try:
            return rc, json.loads((out / "report.json").read_text())
        except (OSError, ValueError):
            return rc, None

    def _verify(self, client, cid: str) -> dict:
        """Bitwise exactness and the full tier against the serving pass, on the campaign engine."""
        ev: dict = {"campaign_candidate": cid, "engine": client.url}
        exact = client.call("check_bit_exact", candidate_id=cid)
        ev["exact"] = {k: exact.get(k) for k in ("ok", "exact", "tokens_equal", "kv_equal", "max_abs_diff",
                                                 "first_mismatch", "token_divergence", "violations")}
        serving, s_speed = self.service.active, 1.0
        if serving != "reference":
            src = self.service.engine.candidates[serving].source
            r = client.call("submit_forward_pass", source=src, name=f"serving {serving}")
            sf = client.call("measure_full", candidate_id=r["candidate_id"]) if r.get("ok") else r
            if not sf.get("ok") or not sf.get("speedup"):
                return ev | {"ok": False, "reason": f"could not measure the serving pass {serving} there: "
                                                    f"{sf.get('error')}"}
            s_speed = sf["speedup"]
        full = client.call("measure_full", candidate_id=cid)
        ev["full"] = {k: full.get(k) for k in ("ok", "valid", "speedup", "speedup_ci95", "per_user_tps_p50",
                                               "ttft_ms_p50", "throughput_tps", "tokens_match", "violations")}
        ev["serving"], ev["serving_full_speedup"] = serving, s_speed
        ok, reason = judge(exact, full, s_speed, self.cfg.min_full_gain)
        return ev | {"ok": ok, "reason": reason}

    # -- promotion and canary --

    def promote_with_canary(self, source: str, name: str | None = None, evidence: dict | None = None) -> dict:
        """Hot-swap `source` in, watch it for a canary period, roll back on regression."""
        with self._promoting:
            return self._promote_with_canary(source, name, evidence)

    def _promote_with_canary(self, source: str, name: str | None, evidence: dict | None) -> dict:
        sched = self.service.scheduler
        prev = self.service.active
        baseline = [s for s in list(sched.steps) if s.forward_pass == prev][-self.cfg.baseline_steps:]
        r = self.service.promote(source, name=name, agent_id=AGENT, evidence=evidence)
        if not r["ok"]:
            self.decisions.append({"kind": "candidate_rejected", "candidate_id": r["candidate_id"],
                                   "reason": "install into the serving engine failed"})
            return {"ok": False, "reason": "install failed", **r}
        cid, t_promoted = r["candidate_id"], sched.now()
        self.decisions.append({"kind": "promoted", "candidate_id": cid, "previous": prev, **(evidence or {})})
        self.status = "canary"
        verdict = self.canary(cid, t_promoted, baseline)
        self.event("canary", {"previous": prev, **verdict}, candidate_id=cid)
        out = {"ok": True, "candidate_id": cid, "previous": prev, "canary": verdict}
        if verdict["verdict"] == "regressed" and self.service.active == cid:
            self.service.rollback(prev, reason=f"canary: decode steps {verdict['ratio']:.2f}x the previous pass's",
                                  agent_id=AGENT, evidence={"canary": verdict})
            self.decisions.append({"kind": "rolled_back", "candidate_id": cid, "to": prev})
            out["rolled_back"] = True
        return out

    def canary(self, cid: str, since: float, baseline: list) -> dict:
        sched, cfg = self.service.scheduler, self.cfg
        deadline = time.monotonic() + cfg.canary_max_s
        while True:
            new = [s for s in list(sched.steps) if s.forward_pass == cid and s.t > since]
            if self.service.active != cid:
                return {"verdict": "replaced", "ratio": None, "new_steps": len(new),
                        "reason": f"the serving pass is now {self.service.active} (it raised, or was replaced)"}
            if len(new) >= cfg.canary_min_steps or time.monotonic() > deadline or self._stop.is_set():
                return compare_steps(baseline, new, cfg.canary_tolerance, cfg.canary_min_steps)
            time.sleep(0.05)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
