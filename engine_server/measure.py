"""Two measurement tiers, reference and candidate A/B in the same call, on real traffic.

Fast tier (`fast`): an estimate of the full tier's speedup in seconds. Shapes: decode
batches at context lengths sampled from the trace (batch 1 and a batch of the trace's
concurrency) and one prefill at the mean prompt length, capped as the full tier caps them,
KV cache prefilled by the reference from real prompt text. Each decode shape is timed on a
subset of the layers (engine.fast_layers, about a fifth; with all of them, fast_fraction 1,
every shape is timed at full depth and nothing below applies) and on no layers; its full-depth
time is extrapolated from the two (per-forward work once, per-layer work L times), and a
depth check times the batch-1 shape at full depth too, in rounds drawn at random, just
after its fast-layer and no-layer timings: full depth over its extrapolation must match
the reference's (whose ratios are pooled across calls that pass, DEPTH_POOL), and so must
the shape's speedup over its speedup at full depth in those rounds (`_estimate_check`). The prefill
is extrapolated and depth-checked as the decode shapes are (`fast_prefill="layers"`, the
default), or timed at full depth (one eager pass, "full").
The shapes are weighted by how many ops of their kind the full tier's schedule holds, and a
decode shape's steps per timing follow its weight: fast_iters for the heaviest, fewer (at least
one) for a lighter one, whose noise moves the weighted sum less (`FastSetup.weigh`).

Full tier (`full`): all layers, a replay of the trace: its first requests, lengths capped by
config, arrivals in trace time, up to max_batch requests decoding together. The schedule
(which rows run in which step) is fixed by a first reference pass, so both sides replay the
same operations; each operation is timed and the virtual clock gives per-user tokens/s,
time to first token and throughput for each side. Greedy tokens must equal the
reference's at every step, or differ only at near ties (`near_tie`: what another
summation order can flip in a pass that is close but not bitwise).

Both: rounds alternate which side goes first; warm-up dropped; medians with spread;
speedup = reference time / candidate time with a paired bootstrap 95% interval; the fast
tier's rounds stop once that interval is narrow enough (`should_stop`: +-5% after 9 rounds on
the CPU, +-1% after 5 on CUDA) and its result says where its seconds went (`phases_s`). On
CUDA the decode steps replay each forward pass's CUDA graphs and are timed with CUDA events.
The timed outputs are compared with the reference's on the same inputs: a candidate that is
fast only while timed (skips layers, returns stale results) is flagged, not rewarded.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from engine_server.guards import settled
from engine_server.results import MeasureResult, ShapeTiming
from engine_server.state import Batch, decode_batch, prefill_batch

BANDWIDTH_BYTES_S = 4.3e12  # measured H200 copy bandwidth; the fast tier's plausibility floor
# a full-depth step may take this much more than extrapolated, relative to the reference's,
# judged on at least this many check rounds (each timing the fast layers, none, then full
# depth, back to back), then on twice as many more if it failed. Each timed round is a check round
# with the chance DEPTH_REPS / fast_min_rounds, drawn from the OS's entropy (`_depth_odds`):
# no pass can tell which rounds will be checked, so one that pads its no-layer steps in more
# than half the rounds (what it takes to move the median) shows it in about as many of the
# check rounds, and a pass honest only just after a full-depth step, whose check rounds look
# honest when one came just before them (tests/cheaters/depth_counter.py), shows it in its
# speedup over its speedup at full depth (`_estimate_check`); the warm-up rounds are drawn the same way, so
# the first full-depth step may come in the first round. (CPU: 3 decode rounds give the verdicts 5
# gave, reference copies passing and the depth padder of tests/cheaters far outside:
# benchmarks/results/cpu_depth_check_*.json; a prefill checked on 2 rounds judged their mean,
# which one preempted timing on a loaded host swung both ways)
DEPTH_SLACK = {"cuda": 1.25, "cpu": 1.4}
DEPTH_REPS = {"cuda": 5, "cpu": 3}
# an extrapolated prefill is checked on fewer: one eager full-depth pass costs as much as a
# round's decode steps, and padding that pays (the prefill padder in tests/test_engine.py:
# 3.3-3.5x against the reference's 1.0-1.1x on the CPU) is far outside the slack. On CUDA two:
# the eager full-depth prefill is most of the depth check's time there, its timing steady
# (no preempted timings to outvote), and their mean flags a pass that pads either of them
DEPTH_REPS_PREFILL = {"cuda": 2, "cpu": 3}
# the reference's side of the depth check is pooled across calls: full depth over its
# extrapolation is a ratio of two timings taken together, so the machine's speed of the moment
# cancels in it and it is the same quantity in every call. Once the pool holds twice a shape's
# fewest check rounds (from calls that passed every check), the reference times that shape at
# full depth in one check round a call (keeping the pool current) instead of in every one, and
# the first look judges the candidate against the median of the pool's last DEPTH_POOL ratios;
# a recheck times both sides afresh and is judged on those alone
DEPTH_POOL = 15
# full tier: a greedy token that differs from the reference's is a near tie (not a violation)
# when the reference itself ranks it among its top NEAR_TIE_K within NEAR_TIE_REL of its
# top logit: what rounding in another summation order can flip (tolerance-gated passes)
NEAR_TIE_K, NEAR_TIE_REL = 8, 0.02


class CandidateFailure(Exception):
    """The candidate's forward raised while being measured or checked."""

    def __init__(self, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.exc = exc


def call(fn, *args):
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - the candidate's failure, not ours
        if isinstance(e, TimeoutError):
            raise
        raise CandidateFailure(e) from None


# ---- statistics ----------------------------------------------------------------------

def iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def bootstrap_replays(ref: list[list[float]], cand: list[list[float]], n: int = 1000,
                      seed: int = 0) -> tuple[float, float]:
    """95% interval of the full tier's speedup, resampling at both levels: replays (paired, so
    a slow spell of the machine counts) and then operations (so a few long ops count)."""
    rng = random.Random(seed)
    reps, ops = len(ref), len(ref[0])
    vals = []
    for _ in range(n):
        rs = [rng.randrange(reps) for _ in range(reps)]
        r_med = [statistics.median(ref[i][k] for i in rs) for k in range(ops)]
        c_med = [statistics.median(cand[i][k] for i in rs) for k in range(ops)]
        ks = [rng.randrange(ops) for _ in range(ops)]
        den = sum(c_med[k] for k in ks)
        vals.append(sum(r_med[k] for k in ks) / den if den > 0 else float("inf"))
    vals.sort()
    return vals[int(0.025 * n)], vals[min(n - 1, int(0.975 * n))]


def bootstrap_median(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of xs (n resamples, drawn all at once: ~1 ms for
    21 values, so the fast tier can afford it after every round)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(xs, dtype=torch.float64)
    m = len(xs)
    s = x[torch.randint(m, (n, m), generator=g)].sort(dim=1).values  # [n, m]: each resample sorted
    vals = ((s[:, (m - 1) // 2] + s[:, m // 2]) / 2).sort().values  # the resamples' medians
    return vals[int(0.025 * n)].item(), vals[min(n - 1, int(0.975 * n))].item()


def half_width(ci: tuple[float, float], centre: float) -> float:
    """Half the interval's width relative to its centre estimate: 0.05 means +-5%."""
    return (ci[1] - ci[0]) / 2 / centre if centre > 0 else float("inf")


def should_stop(ratios: list[float], least: int, most: int, target: float) -> str | None:
    """Whether the fast tier's rounds stop after these paired ratios, and why: "max_rounds",
    or "ci" once there are at least `least` of them and the 95% interval of their median is
    within +-target of it (a fixed-width sequential interval, as Chow & Robbins 1965: a quiet
    machine or a large difference stops early, a noisy tie runs to `most`). None: go on."""
    if len(ratios) >= most:
        return "max_rounds"
    if target > 0 and len(ratios) >= least:
        if half_width(bootstrap_median(ratios), statistics.median(ratios)) <= target:
            return "ci"
    return None


# ---- fast tier -----------------------------------------------------------------------

@dataclass
class Shape:
    name: str
    batch: Batch  # decode: real next tokens at each row's context length; prefill: one prompt
    contexts: list[int]
    prefill: bool = False
    weight: float = 1.0  # how many ops of this kind the full tier's replay runs (see FastSetup.weigh)
    iters: int = 1  # steps per timing (decode: set by FastSetup.weigh; a prefill is one eager pass)

    @property
    def size(self) -> int:
        return self.batch.size


@dataclass
class FastSetup:
    """The fast tier's shapes, the cache they read, and what a full-depth step must read.

    Each decode shape is timed at the fast layers (k of them) and at no layers at all; the
    pass's full-depth time is extrapolated as t0 + (tk - t0) * L / k, so per-forward work
    (embedding, final norm, lm_head) counts once and per-layer work L times, as in the
    full tier. The prefill shape is timed at full depth (or, with fast_prefill="layers",
    extrapolated the same way). Shapes are weighted by how often the full tier's replay runs
    their kind of op (prefill tokens, single-row and batched decode steps), read off its
    schedule."""
    shapes: list[Shape]
    kv: tuple  # cache snapshot after the reference prefilled every shape's rows
    experts_active: float | None = None
    step_bytes: int = 0  # weight bytes any full-depth step must read (a floor)
    weighted: bool = False
    # the reference's depth-check ratios by shape, from calls that passed every check (DEPTH_POOL)
    ref_depth: dict[str, list[float]] = field(default_factory=dict)
    # the reference's timed outputs by (depth, shape): the same cache and inputs give the same
    # outputs, so each is computed once
    ref_outputs: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, eng) -> "FastSetup":
        from engine_server.traffic import cap
        cfg, state = eng.config, eng.state
        limit = max(1, min(cfg.full_max_prompt, state.max_seq - 2))  # the traffic the full tier replays
        ctx = [max(1, min(r.prompt_len, limit)) for r in _sample(eng, max(1, cfg.fast_contexts))]
        wide = min(cfg.max_batch - len(ctx), max(2, round(eng.traffic.profile.concurrency)))
        groups = [[c] for c in sorted(set(ctx))]
        if wide > 1:
            groups.append([max(1, min(r.prompt_len, limit)) for r in _sample(eng, wide, seed=1)])
        shapes, slot = [], 0
        with torch.no_grad():
            for contexts in groups:
                rows = []
                for c in contexts:
                    ids = eng.traffic.tokens(c + 1, slot)
                    prompt = torch.tensor([ids[:c]], device=eng.device)
                    eng.family.forward(state, prefill_batch(prompt, torch.tensor([slot], device=eng.device)))
                    rows.append((ids[c], c, slot))
                    slot += 1
                t, p, s = (torch.tensor(x, device=eng.device) for x in zip(*rows))
                name = f"decode B={len(rows)} ctx={','.join(map(str, contexts))}"
                shapes.append(Shape(name, decode_batch(t, p, s), contexts))
        reqs = cap(eng.traffic.trace, cfg.full_max_prompt, cfg.full_max_output, cfg.full_requests).requests
        plen = max(1, min(round(statistics.mean(r.prompt_len for r in reqs)), limit))
        prompt = torch.tensor([eng.traffic.tokens(plen, 7)], device=eng.device)
        # the padding slot: nothing the decode shapes read
        shapes.append(Shape(f"prefill T={plen}", prefill_batch(prompt, torch.tensor([eng.pad_slot], device=eng.device)),
                            [plen], prefill=True))
        setup = cls(shapes, state.clone_cache())
        if eng.model.is_moe:
            setup.experts_active = _experts_active(eng, [s for s in shapes if not s.prefill])
            state.load_cache(*setup.kv)
        # a floor, so MoE experts (a step reads only the routed ones) are left out
        layer_bytes = sum(t.numel() * t.element_size() for k, t in state.weights.items()
                          if (".layers." in k or ".h." in k) and ".experts." not in k)
        head = eng.model.vocab_size * eng.model.hidden_size * state.weights[next(iter(state.weights))].element_size()
        setup.step_bytes = layer_bytes + head
        return setup

    def weigh(self, sched: "Schedule", iters: int) -> None:
        """Weights from the full tier's schedule: the prefill shape counts for all prefill
        tokens (prefill time grows with tokens), single-row decode ops are shared by the
        batch-1 shapes, batched ones go to the wide shape. Steps per timing: `iters` for the
        heaviest decode shape, a lighter one in proportion to its weight, at least one (its
        timing's noise counts in the weighted sum in proportion to its weight, so its steps are
        spent where they narrow the estimate: the CPU's wide shape, 6 ops against the batch-1
        shape's 57, costs a third of a round at 3 steps)."""
        pre = [op for op in sched.ops if op.kind == "prefill"]
        dec = [op for op in sched.ops if op.kind == "decode"]
        one = [s for s in self.shapes if not s.prefill and s.size == 1]
        wide = [s for s in self.shapes if not s.prefill and s.size > 1]
        n_one = sum(1 for op in dec if len(op.reqs) == 1)
        n_wide = len(dec) - n_one
        if not wide:
            n_one, n_wide = len(dec), 0
        for s in self.shapes:
            if s.prefill:
                s.weight = sum(op.batch.seq_len for op in pre) / s.batch.seq_len
            else:
                s.weight = (n_one / len(one)) if s.size == 1 else n_wide / len(wide)
        top = max((s.weight for s in self.shapes if not s.prefill), default=0.0)
        for s in self.shapes:
            if not s.prefill:
                s.iters = max(1, round(iters * s.weight / top)) if top > 0 else iters
        self.weighted = True


def _sample(eng, n: int, seed: int = 0):
    from engine_server.traffic import sample_lengths
    return sample_lengths(eng.traffic.trace, n, seed=seed)


def _experts_active(eng, shapes: list[Shape]) -> float:
    from engine_server.models.moe import experts_active
    vals = []
    for s in shapes:
        b = s.batch.clone()
        b.expert_log = []
        eng.family.forward(eng.state, b)
        vals.append(experts_active(b.expert_log)["mean_per_layer"])
    return round(statistics.mean(vals), 3)


def _time_steps(eng, cand, state, shape: Shape) -> float:
    """Seconds per step of `cand` on `shape` over its `iters` steps (decode: graph replay + CUDA
    events on CUDA; prefill: one eager pass, as the full tier runs it)."""
    iters = shape.iters
    if eng.cuda and not shape.prefill and cand.graphs is not None and cand.graphs.has(state, shape.size):
        eng.inputs.fill(shape.batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            cand.graphs.replay(state, shape.size)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    if eng.cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        call(cand.forward, state, shape.batch)
    if eng.cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def depth_estimate(t0: float, tk: float, k: int, layers: int) -> float:
    """Full-depth time from the time at no layers (t0) and at k layers (tk)."""
    return t0 + max(0.0, tk - t0) * layers / k


def check_logits(out, batch: Batch, vocab: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """`out` if it is what the contract asks of forward: a tensor [B, vocab] (and, given them,
    in the reference's dtype on the engine's device); else TypeError/ValueError saying what it
    returned instead."""
    if type(out) is not torch.Tensor:  # a subclass could answer torch.equal for the checks itself
        raise TypeError(f"forward returned {type(out).__name__}, expected a plain torch.Tensor [B, vocab]")
    if tuple(out.shape) != (batch.size, vocab):
        raise ValueError(f"forward returned shape {tuple(out.shape)} for a batch of {batch.size} rows, "
                         f"expected {(batch.size, vocab)}")
    if dtype is not None and out.dtype != dtype:
        raise TypeError(f"forward returned {out.dtype} logits, expected {dtype} (the reference's)")
    if device is not None and out.device.type != device.type:
        raise TypeError(f"forward returned logits on {out.device}, expected them on {device}")
    return out


def output(eng, out, batch: Batch) -> torch.Tensor:
    """A forward pass's output, checked (`check_logits`) before the engine reads it: one that
    breaks the contract is the candidate's failure (CandidateFailure), not the engine's."""
    return call(check_logits, out, batch, eng.model.vocab_size, eng.logits_dtype, eng.device)


def run_step(eng, cand, state, batch: Batch) -> tuple[torch.Tensor, list[str]]:
    """One forward pass through the same path timing uses (graph if captured), settled and
    checked (`output`)."""
    if eng.cuda and cand.graphs is not None:
        out, viol = call(settled, lambda: cand.graphs.run(state, batch))
    else:
        out, viol = call(settled, lambda: cand.forward(state, batch))
    return output(eng, out, batch), viol


def compare(ref: torch.Tensor, out: torch.Tensor, rel: float = 1e-2) -> tuple[str, float]:
    """'bitwise', 'close' (max |diff| <= rel * max |ref|) or 'differ', and the max |diff|."""
    if out.shape != ref.shape:
        return "differ", float("inf")
    if torch.equal(ref, out):
        return "bitwise", 0.0
    diff = (ref.float() - out.float()).abs().max().item()
    if diff != diff:  # NaN
        return "differ", float("nan")
    return ("close" if diff <= rel * ref.float().abs().max().item() else "differ"), diff


def fast(eng, cand) -> MeasureResult:
    t_start = time.perf_counter()
    cfg, setup = eng.config, eng.fast_setup
    if not setup.weighted:
        if eng.replay_schedule is None:
            eng.replay_schedule = build_schedule(eng)
        setup.weigh(eng.replay_schedule, cfg.fast_iters)
    ref = eng.candidates["reference"]
    L, k = len(eng.state.layers), len(eng.fast_layers)
    # shapes run at the fast layers ("k") and at none ("0"); at full depth ("L") instead when
    # the fast layers are all of them, or for the prefill (one eager pass) with fast_prefill="full"
    depths = {"k": eng.fast_layers, "0": (), "L": eng.state.layers}
    plan = [(d, sh) for sh in setup.shapes for d in (("L",) if _full_depth(eng, sh) else ("k", "0"))]
    # the depth check's shapes: the first decode shape, and the prefill, when extrapolated; in
    # the rounds drawn for it, their full depth is timed right after their "k" and "0" timings
    checked = _depth_checked(eng, setup)
    if checked:
        plan = _check_later(plan, checked[0].name)
    odds = {sh.name: _depth_odds(eng, sh) for sh in checked}
    # the shapes whose reference side comes from the pool (DEPTH_POOL), with what it holds
    pool = {sh.name: list(setup.ref_depth[sh.name]) for sh in checked
            if len(setup.ref_depth.get(sh.name, ())) >= 2 * _depth_least(eng, sh)}
    rng = random.SystemRandom()
    sides = {side: (c, {d: eng.candidate_state(c, ls) for d, ls in depths.items()})
             for side, c in (("ref", ref), ("cand", cand))}
    eng.state.load_cache(*setup.kv)
    raw = {s: {(d, sh.name): [] for d, sh in plan} for s in sides}
    depth: dict[str, dict[str, list[float]]] = {s: {sh.name: [] for sh in checked} for s in sides}
    full: dict[str, list[float]] = {sh.name: [] for sh in checked}  # full-depth speedups (`_full_speedups`)
    # where the call's seconds go, for whoever wants the tier cheaper (result config "phases_s")
    phases = {"setup": time.perf_counter() - t_start, "rounds_decode": 0.0, "rounds_prefill": 0.0,
              "depth_check": 0.0}

    def estimate(s: str, sh: Shape, i: int) -> float:
        """Round i's full-depth estimate of one shape on side s."""
        if _full_depth(eng, sh):
            return raw[s]["L", sh.name][i]
        return depth_estimate(raw[s]["0", sh.name][i], raw[s]["k", sh.name][i], k, L)
    # paired per round: drift of the machine between rounds cancels in each ratio
    ratios: list[float] = []
    stopped = None
    r = 0
    while stopped is None:
        i = r - cfg.warmup_rounds  # < 0: a warm-up round, its timings dropped
        # warm-up rounds are drawn as check rounds too (their samples dropped as well): a pass
        # that pads until it has seen a full-depth step would otherwise pad the first timed
        # rounds for free, and a few padded rounds move a noisy median by a rank or two
        check = _drawn(odds, rng, odds)
        # a pooled shape's reference full depth: once a call, in a timed round
        skip = {n for n in pool if i < 0 or depth["ref"][n]}
        got = _timed_round(eng, sides, plan, r, check, phases, skip)
        if i >= 0:
            for s in sides:
                for d, sh in plan:
                    raw[s][d, sh.name].append(got[s][d, sh.name])
                for name, x in _depth_samples(eng, got[s], check).items():
                    depth[s][name].append(x)
            for name, x in _full_speedups(eng, got, check).items():
                full[name].append(x)
            a, b = (sum(sh.weight * estimate(s, sh, i) for sh in setup.shapes) for s in ("ref", "cand"))
            ratios.append(a / b if b > 0 else float("inf"))
            stopped = should_stop(ratios, cfg.fast_min_rounds, cfg.fast_rounds, cfg.fast_ci)
        r += 1
    t0 = time.perf_counter()  # fewer check rounds than the least: more rounds, drawn the same way
    more = _depth_rounds(eng, sides, plan, odds, rng, {sh.name: _depth_least(eng, sh) - len(depth["cand"][sh.name])
                                                         for sh in checked}, set(pool), {n for n in pool if depth["ref"][n]}, full)
    for s in sides:
        for name, xs in more[s].items():
            depth[s][name] += xs
    phases["depth_check"] += time.perf_counter() - t0
    n = len(ratios)
    # full-depth estimate of every sample: the paired rounds stay paired
    est = {s: {sh.name: [estimate(s, sh, i) for i in range(n)] for sh in setup.shapes} for s in sides}
    res = MeasureResult(candidate_id=cand.id, tier="fast", ok=True, samples=n,
                        layers=list(eng.fast_layers), config=_config(eng))
    res.speedup = statistics.median(ratios)
    res.speedup_ci95 = bootstrap_median(ratios)
    res.config["stopped"] = {"rounds": n, "why": stopped,
                             "ci_half_width": round(half_width(res.speedup_ci95, res.speedup), 4)}
    decode = [sh for sh in setup.shapes if not sh.prefill]
    med = {s: {sh.name: statistics.median(est[s][sh.name]) for sh in setup.shapes} for s in sides}
    res.step_ms = statistics.mean(med["cand"][sh.name] for sh in decode) * 1e3
    res.reference_step_ms = statistics.mean(med["ref"][sh.name] for sh in decode) * 1e3
    tokens = sum(sh.size for sh in decode)
    res.tokens_per_s = tokens / sum(med["cand"][sh.name] for sh in decode)
    res.reference_tokens_per_s = tokens / sum(med["ref"][sh.name] for sh in decode)
    res.experts_active = setup.experts_active
    for sh in setup.shapes:
        mc, mr = med["cand"][sh.name], med["ref"][sh.name]
        res.shapes.append(ShapeTiming(shape=sh.name, batch=sh.size, context=max(sh.contexts), step_ms=mc * 1e3,
                                      reference_step_ms=mr * 1e3, speedup=mr / mc if mc > 0 else float("inf"),
                                      spread_ms=iqr(est["cand"][sh.name]) * 1e3, weight=round(sh.weight, 3),
                                      tokens_per_s=(sh.size if not sh.prefill else sh.batch.seq_len) / mc
                                      if mc > 0 else 0.0))
    # the timed outputs, against the reference's from the same cache, each settled (guards.settled:
    # stray streams and threads must have landed when forward returns)
    t0 = time.perf_counter()
    worst = "bitwise"
    for d, sh in plan:
        eng.state.load_cache(*setup.kv)
        out, viol = run_step(eng, cand, sides["cand"][1][d], sh.batch)
        ref_out, ref_viol = _reference_output(eng, setup, sides["ref"][1][d], d, sh)
        res.violations += viol + ref_viol
        verdict, diff = compare(ref_out, out)
        if verdict == "differ":
            where = {"k": "the fast layers", "0": "no layers", "L": "all layers"}[d]
            res.violations.append(f"timed outputs differ from the reference's on {sh.name} at {where} "
                                  f"(max abs diff {diff:.3g}): it computes something else when measured")
        worst = max(worst, verdict, key=("bitwise", "close", "differ").index)
    res.outputs_match = worst
    phases["outputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = {sh.name: [] for sh in checked}  # a recheck's full-depth speedups

    def recheck(name: str, need: int) -> dict:
        """`need` more check rounds of shape `name`: their depth ratios; again[name] their
        full-depth speedups."""
        again[name] = []
        return _depth_rounds(eng, sides, plan, odds, rng, {name: need}, full=again)

    def recheck_full(name: str, need: int) -> list[float]:
        recheck(name, need)
        return again[name]
    _depth_check(eng, res, depth, recheck, pool)
    _estimate_check(eng, res, {name: again[name] or xs for name, xs in full.items()},
                    {name: [a / b if b > 0 else float("inf") for a, b in zip(est["ref"][name], est["cand"][name])]
                     for name in full}, recheck_full)
    phases["depth_check"] += time.perf_counter() - t0  # a recheck's rounds
    _plausibility(eng, res, setup)
    res.valid = not res.violations
    eng.state.load_cache(*setup.kv)
    phases["total"] = time.perf_counter() - t_start
    res.config["phases_s"] = {k: round(v, 4) for k, v in phases.items()}
    return res


def _reference_output(eng, setup: FastSetup, state, d: str, sh: Shape) -> tuple[torch.Tensor, list[str]]:
    """The reference's output on `sh` at depth `d` from the fast tier's cache, and what its
    settle check found: computed at the first call (cloned: a graph's output buffer is reused)
    and kept in setup.ref_outputs, since the same cache and inputs give the same output."""
    key = (d, sh.name)
    if key in setup.ref_outputs:
        return setup.ref_outputs[key], []
    eng.state.load_cache(*setup.kv)
    out, viol = run_step(eng, eng.candidates["reference"], state, sh.batch)
    setup.ref_outputs[key] = out.clone()
    return setup.ref_outputs[key], viol


def _full_depth(eng, sh: Shape) -> bool:
    """Whether the fast tier times this shape at full depth rather than extrapolating it: when
    its fast layers are all the layers (fast_fraction 1), or it is the prefill and
    fast_prefill is "full"."""
    return _every_layer(eng) or (sh.prefill and eng.config.fast_prefill == "full")


def _every_layer(eng) -> bool:
    """Whether the fast layers are all the layers (fast_fraction 1): nothing to extrapolate."""
    return len(eng.fast_layers) == len(eng.state.layers)


def _depth_checked(eng, setup: FastSetup) -> list[Shape]:
    """The shapes whose extrapolation the depth check tests: the first decode shape and the
    prefill, each when it is extrapolated (none when all are timed at full depth)."""
    first = next(s for s in setup.shapes if not s.prefill)
    return [s for s in setup.shapes if (s is first or s.prefill) and not _full_depth(eng, s)]


def _check_later(plan: list, name: str) -> list:
    """`plan` with the timings of shape `name` moved after those of the shape that opened it
    (when there is another): the first timing of each side's turn pays for the switch from
    the other side, and a depth check's extrapolation multiplies the error of its shape's
    fast-layer time by L / k."""
    rest = [e for e in plan if e[1].name != name]
    if not rest:
        return plan
    lead = [e for e in rest if e[1].name == rest[0][1].name]
    return lead + [e for e in plan if e[1].name == name] + rest[len(lead):]


def _depth_odds(eng, sh: Shape) -> float:
    """The chance that a timed round times `sh` at full depth too: DEPTH_REPS (the prefill:
    DEPTH_REPS_PREFILL) over the rounds the fast tier runs at least."""
    return min(1.0, _depth_least(eng, sh) / max(1, eng.config.fast_min_rounds))


def _depth_least(eng, sh: Shape) -> int:
    """The fewest check rounds a verdict on `sh` rests on."""
    return (DEPTH_REPS_PREFILL if sh.prefill else DEPTH_REPS)["cuda" if eng.cuda else "cpu"]


def _drawn(odds: dict[str, float], rng, names) -> set[str]:
    """The shapes among `names` that this round checks, each drawn with its odds."""
    return {name for name in names if rng.random() < odds[name]}


def _timed_round(eng, sides: dict, plan: list, r: int, check: set[str], phases: dict | None = None,
                 ref_skip: set[str] = frozenset()) -> dict:
    """One round: each side (which goes first alternating with r) times every (depth, shape) of
    `plan`, and right after a shape's no-layer timing its full depth ("L") when the shape is in
    `check` (the reference: and not in `ref_skip`, the shapes its pool stands for): nothing a
    pass sees before its no-layer steps says whether the round checks them.
    Returns {side: {(depth, shape name): seconds a step}}; adds to `phases` where given."""
    out: dict = {s: {} for s in sides}
    for side in (("ref", "cand") if r % 2 == 0 else ("cand", "ref")):
        c, states = sides[side]
        checked = check - ref_skip if side == "ref" else check
        for d, sh in plan:
            t0 = time.perf_counter()
            out[side][d, sh.name] = _time_steps(eng, c, states[d], sh)
            t1 = time.perf_counter()
            if d == "0" and sh.name in checked:
                out[side]["L", sh.name] = _time_steps(eng, c, states["L"], sh)
            if phases is not None:
                phases["rounds_prefill" if sh.prefill else "rounds_decode"] += t1 - t0
                phases["depth_check"] += time.perf_counter() - t1
        if side == "cand":  # what its turn left patched must not reach the reference's next one
            eng.sweep_guards()
    return out


def _depth_samples(eng, got: dict, check: set[str]) -> dict[str, float]:
    """One side's round timings -> full-depth time over its extrapolation, by checked shape
    (those it timed at full depth)."""
    k, L = len(eng.fast_layers), len(eng.state.layers)
    out = {}
    for name in check & {n for d, n in got if d == "L"}:
        e = depth_estimate(got["0", name], got["k", name], k, L)
        out[name] = got["L", name] / e if e > 0 else float("inf")
    return out


def _full_speedups(eng, got: dict, check: set[str]) -> dict[str, float]:
    """A round's timings -> the reference's extrapolated step over the candidate's full-depth
    step, by checked shape: the candidate's speedup at full depth, paired within the round so
    that the machine's speed of the moment cancels, as it does in the speedup."""
    k, L = len(eng.fast_layers), len(eng.state.layers)
    out = {}
    for name in check & {n for d, n in got["cand"] if d == "L"}:
        t = got["cand"]["L", name]
        out[name] = depth_estimate(got["ref"]["0", name], got["ref"]["k", name], k, L) / t if t > 0 else 0.0
    return out


def _depth_rounds(eng, sides: dict, plan: list, odds: dict, rng, need: dict[str, int],
                  ref_once: set[str] = frozenset(), ref_done: set[str] = frozenset(),
                  full: dict | None = None) -> dict:
    """Whole rounds as the fast tier's (each drawn as a check round with the same odds) until
    every shape in `need` has that many more check rounds; the reference times a shape of
    `ref_once` (its pool stands for it) at full depth once a call: not at all if it is in
    `ref_done` (timed already), else in the first of these rounds that checks it.
    {side: {shape: [ratios]}}; each round's full-depth speedup (`_full_speedups`) is also
    added to `full[shape]` where given."""
    out: dict = {s: {name: [] for name in need} for s in sides}
    r = 0
    while any(len(out["cand"][name]) < n for name, n in need.items()):
        check = _drawn(odds, rng, [name for name, n in need.items() if len(out["cand"][name]) < n])
        skip = {n for n in ref_once if n in ref_done or out["ref"].get(n)}
        got = _timed_round(eng, sides, plan, r, check, ref_skip=skip)
        for s in sides:
            for name, x in _depth_samples(eng, got[s], check).items():
                out[s][name].append(x)
        if full is not None:
            for name, x in _full_speedups(eng, got, check).items():
                full[name].append(x)
        r += 1
    return out


def _depth_check(eng, res: MeasureResult, depth: dict, recheck, pool: dict[str, list[float]] | None = None) -> None:
    """The extrapolation holds only if time grows with the layers run: a pass that pads its
    no-layer step (or slows down at full depth) would look faster than it is. In the check
    rounds (drawn at random among the timed rounds, at least DEPTH_REPS of them; the prefill
    DEPTH_REPS_PREFILL) each side's checked shapes were timed at the fast layers, at none and
    at full depth, back to back; each such round gives full-depth time over its
    extrapolation, and the candidate's median ratio must stay within the slack of the
    reference's (wider on the CPU, whose timings are noisier). Timed together, the three share
    the machine's state of the moment. A shape that fails is timed in twice as many check
    rounds again (`recheck(shape, rounds)`, whole rounds drawn the same way) and judged on those: a
    noisy spell of the machine during the first look does not fail a correct pass, while
    padding shows in the check rounds as often as in the others and stays far outside the
    slack. depth: each side's ratios by shape name; pool: the reference's earlier ratios for
    the shapes it stands for (DEPTH_POOL), which the first look adds to the reference's own."""
    kind = "cuda" if eng.cuda else "cpu"
    res.config["depth_check"] = {}  # shape -> side -> measured / extrapolated full-depth time
    for name, cand_ratios in depth["cand"].items():
        earlier = (pool or {}).get(name, [])
        fresh = list(depth["ref"][name])
        ratio = {"ref": statistics.median(earlier + fresh), "cand": statistics.median(cand_ratios)}
        rounds = len(cand_ratios)
        rechecked = ratio["cand"] > DEPTH_SLACK[kind] * ratio["ref"]
        if rechecked:
            more = recheck(name, 2 * rounds)
            ratio = {s: statistics.median(more[s][name]) for s in depth}
            fresh += more["ref"][name]
        res.config["depth_check"][name] = {s: round(r, 3) for s, r in ratio.items()}
        res.config["depth_check"][name]["repetitions"] = rounds * (1 + 2 * rechecked)
        res.config["depth_check"][name]["rechecked"] = rechecked
        # the reference's ratios this call timed (they join the pool if the call passes), and
        # how many earlier ones its first look used
        res.config["depth_check"][name]["reference_fresh"] = [round(x, 4) for x in fresh]
        res.config["depth_check"][name]["reference_pooled"] = len(earlier)
        if ratio["cand"] > DEPTH_SLACK[kind] * ratio["ref"]:
            res.violations.append(f"{name}: a full-depth step takes {ratio['cand']:.2f}x the time the fast "
                                  f"tier's depth extrapolation gives (reference {ratio['ref']:.2f}x): its time "
                                  f"does not grow with the layers it runs as it should")


def _estimate_check(eng, res: MeasureResult, full: dict[str, list[float]], ratios: dict[str, list[float]],
                    recheck) -> None:
    """The depth check judges each check round's own extrapolation; the speedup rests on the
    median of every round's. A pass that is honest only for a while after a full-depth step
    (tests/cheaters/depth_counter.py) pads the rounds that follow no check round, and its
    check rounds look honest whenever a check round came just before them. So the shape's
    speedup (the median of its rounds' ratios) over its speedup at full depth (the median of
    its check rounds' `_full_speedups`) must also stay within the slack of the reference's
    full depth over its extrapolation (the depth check's ratio). Both are paired within
    rounds, so a machine that speeds up or slows down during the call moves neither. As in
    the depth check, a shape outside the slack is judged again on twice as many check rounds
    (`recheck(shape, rounds)` -> their full-depth speedups), so that a few noisy check rounds
    do not fail a correct pass; padding shows in those as in the first (their full depth is
    honest, the speedup is not). A shape the depth check rechecked comes with its recheck's
    rounds and is judged on those alone. full, ratios: by shape name."""
    kind = "cuda" if eng.cuda else "cpu"
    for name, xs in full.items():
        check = res.config.get("depth_check", {}).get(name)
        if not xs or check is None:
            continue
        speedup = statistics.median(ratios[name])

        def judged(at_full: list[float]) -> float:
            m = statistics.median(at_full)
            return speedup / m if m > 0 else float("inf")
        got = judged(xs)
        check["estimate_rechecked"] = got > DEPTH_SLACK[kind] * check["ref"] and not check["rechecked"]
        if check["estimate_rechecked"]:
            check["first_cand_over_estimate"] = round(got, 3)
            got = judged(recheck(name, 2 * len(xs)))
        check["cand_over_estimate"] = round(got, 3)
        if got > DEPTH_SLACK[kind] * check["ref"]:
            res.violations.append(f"{name}: its speedup is {got:.2f}x its speedup at full depth, the median "
                                  f"estimate it rests on (reference's full depth over its extrapolation "
                                  f"{check['ref']:.2f}x): its rounds are faster than its full depth is")


def pool_reference_depth(setup: FastSetup, res: MeasureResult) -> None:
    """After a fast-tier call that passed every check (the engine's guards included): the
    reference's depth-check ratios it timed join the pool, which keeps the last DEPTH_POOL."""
    if not (res.ok and res.valid):
        return
    for name, check in res.config.get("depth_check", {}).items():
        kept = setup.ref_depth.setdefault(name, [])
        kept += check["reference_fresh"]
        del kept[:-DEPTH_POOL]


def _plausibility(eng, res: MeasureResult, setup: FastSetup) -> None:
    if res.speedup > eng.config.implausible_speedup:
        res.violations.append(f"implausible speedup {res.speedup:.1f}x (above {eng.config.implausible_speedup:g}x)")
    if eng.cuda:
        floor = setup.step_bytes / BANDWIDTH_BYTES_S
        for s in res.shapes:
            if s.step_ms / 1e3 < 0.8 * floor:
                res.violations.append(f"{s.shape}: {s.step_ms * 1e3:.1f} us is under the memory-bandwidth "
                                      f"floor of {floor * 1e6:.1f} us for the weights it must read")


def _config(eng) -> dict:
    c = eng.config
    return {"model": eng.model.name, "model_type": eng.model.model_type, "device": c.device, "dtype": c.dtype,
            "traffic": c.traffic, "fast_layers": list(eng.fast_layers), "rounds": c.fast_rounds,
            "min_rounds": c.fast_min_rounds, "target_ci": c.fast_ci,
            "iters": c.fast_iters, "prefill": c.fast_prefill, "warmup_rounds": c.warmup_rounds,
            "graphs": eng.cuda and c.capture_graphs,
            "depth": "every shape at all layers" if _every_layer(eng)
            else "t0 + (tk - t0) * L / k from no layers and the fast layers",
            "weights": {s.name: round(s.weight, 3) for s in eng.fast_setup.shapes},
            "shape_iters": {s.name: s.iters for s in eng.fast_setup.shapes}}


# ---- full tier -----------------------------------------------------------------------

@dataclass
class Op:
    kind: str  # "prefill" (one request, T = prompt) or "decode" (one token per running row)
    reqs: list[int]
    batch: Batch
    eligible_s: float = 0.0  # a prefill cannot start before its request arrives


@dataclass
class Schedule:
    requests: list  # traffic.Request, capped
    ops: list[Op] = field(default_factory=list)


def _padded(eng, tokens: list[int], positions: list[int], slots: list[int]) -> Batch:
    """A decode batch padded to the next captured size with rows on the padding slot."""
    b = len(tokens)
    if eng.cuda and eng.config.capture_graphs:
        size = next(s for s in eng.graph_sizes if s >= b)
        pad = size - b
        tokens, positions, slots = tokens + [0] * pad, positions + [1] * pad, slots + [eng.pad_slot] * pad
    t, p, s = (torch.tensor(x, device=eng.device) for x in (tokens, positions, slots))
    return decode_batch(t, p, s)


def build_schedule(eng) -> Schedule:
    """Plan the replay with the reference's own timings (its first pass is the warm-up)."""
    from engine_server.traffic import cap
    cfg = eng.config
    trace = cap(eng.traffic.trace, cfg.full_max_prompt, cfg.full_max_output, cfg.full_requests)
    reqs = trace.requests
    ids = [eng.traffic.tokens(r.prompt_len + r.output_len, i) for i, r in enumerate(reqs)]
    ref = eng.candidates["reference"]
    st = eng.candidate_state(ref)
    sched = Schedule(reqs)
    clock, queue, free = 0.0, list(range(len(reqs))), list(range(cfg.max_batch))
    running: dict[int, list[int]] = {}  # slot -> [request, tokens generated]
    arrival = lambda i: reqs[i].arrival_s / cfg.trace_speed  # noqa: E731

    def run(op: Op) -> float:
        if eng.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        _run_op(eng, ref, st, op)
        if eng.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    while queue or running:
        while queue and free and arrival(queue[0]) <= clock:
            i, slot = queue.pop(0), free.pop(0)
            P = reqs[i].prompt_len
            op = Op("prefill", [i], prefill_batch(torch.tensor([ids[i][:P]], device=eng.device),
                                                  torch.tensor([slot], device=eng.device)), arrival(i))
            sched.ops.append(op)
            clock = max(clock, op.eligible_s) + run(op)
            running[slot] = [i, 1]
            if reqs[i].output_len <= 1:
                del running[slot]
                free.append(slot)
        if not running:
            if queue:
                clock = max(clock, arrival(queue[0]))
            continue
        slots = sorted(running)
        rows = [(ids[running[s][0]][reqs[running[s][0]].prompt_len + running[s][1] - 1],
                 reqs[running[s][0]].prompt_len + running[s][1] - 1, s) for s in slots]
        op = Op("decode", [running[s][0] for s in slots], _padded(eng, *map(list, zip(*rows))))
        sched.ops.append(op)
        clock += run(op)
        for s in slots:
            running[s][1] += 1
            if running[s][1] >= reqs[running[s][0]].output_len:
                del running[s]
                free.append(s)
        free.sort()
    return sched


def _run_op(eng, cand, state, op: Op) -> torch.Tensor:
    if op.kind == "decode" and cand.graphs is not None:
        return call(cand.graphs.run, state, op.batch)
    return call(cand.forward, state, op.batch)


def _replay(eng, cand, sched: Schedule, top: int = 1) -> tuple[list[float], list]:
    """Per-op seconds and, per op, the real rows' `top` largest logits and their token ids
    (`torch.topk`, outside the timed events; [:, 0] is the greedy token)."""
    st = eng.candidate_state(cand)
    tokens = []
    if eng.cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in sched.ops]
        torch.cuda.synchronize()
        for op, (a, b) in zip(sched.ops, evs):
            a.record()
            out = _run_op(eng, cand, st, op)
            b.record()
            tokens.append(output(eng, out, op.batch)[:len(op.reqs)].topk(top, -1))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in evs], tokens
    secs = []
    for op in sched.ops:
        t = time.perf_counter()
        out = _run_op(eng, cand, st, op)
        secs.append(time.perf_counter() - t)
        tokens.append(output(eng, out, op.batch)[:len(op.reqs)].topk(top, -1))
    return secs, tokens


def user_metrics(sched: Schedule, secs: list[float], speed: float) -> dict:
    """Virtual clock over the fixed schedule with one side's op times."""
    reqs = sched.requests
    first, finish, count = {}, {}, {}
    clock = 0.0
    for op, dt in zip(sched.ops, secs):
        clock = max(clock, op.eligible_s) + dt
        for i in op.reqs:
            count[i] = count.get(i, 0) + 1
            first.setdefault(i, clock)
            finish[i] = clock
    ttft = [first[i] - reqs[i].arrival_s / speed for i in first]
    tps = [(count[i] - 1) / (finish[i] - first[i]) for i in first if count[i] > 1 and finish[i] > first[i]]
    q = lambda xs, p: statistics.quantiles(xs, n=10)[int(p * 10) - 1] if len(xs) >= 2 else (xs[0] if xs else None)  # noqa: E731
    return {"ttft_p50": q(ttft, 0.5), "ttft_p90": q(ttft, 0.9), "tps_p50": q(tps, 0.5), "tps_p90": q(tps, 0.9),
            "throughput": sum(count.values()) / clock if clock > 0 else 0.0}


def near_tie(ref_top, cand_tokens: torch.Tensor) -> bool:
    """Every row whose greedy token differs picked one the reference ranks within
    NEAR_TIE_REL of its own top logit (among its top NEAR_TIE_K)."""
    vals, idx = ref_top.values.float(), ref_top.indices
    for row in (idx[:, 0] != cand_tokens).nonzero().flatten().tolist():
        hit = (idx[row] == cand_tokens[row]).nonzero()
        if len(hit) == 0:
            return False
        top, theirs = vals[row, 0].item(), vals[row, hit[0, 0]].item()
        if top - theirs > NEAR_TIE_REL * max(1.0, abs(top)):
            return False
    return True


def full(eng, cand) -> MeasureResult:
    cfg = eng.config
    if eng.replay_schedule is None:
        eng.replay_schedule = build_schedule(eng)
    sched = eng.replay_schedule
    ref = eng.candidates["reference"]
    runs = {"ref": [], "cand": []}
    toks = {}
    _replay(eng, cand, sched)  # the candidate's warm-up (the reference's was the schedule pass)
    eng.sweep_guards()
    for r in range(cfg.full_reps):
        for side in (("cand", "ref") if r % 2 == 0 else ("ref", "cand")):
            secs, t = _replay(eng, cand if side == "cand" else ref, sched,
                              top=min(NEAR_TIE_K, eng.model.vocab_size) if r == 0 else 1)
            runs[side].append(secs)
            toks.setdefault(side, t)
            eng.sweep_guards()
    n = len(sched.ops)
    med = {s: [statistics.median(run[k] for run in runs[s]) for k in range(n)] for s in runs}
    res = MeasureResult(candidate_id=cand.id, tier="full", ok=True, samples=cfg.full_reps,
                        layers=list(eng.state.layers), config=_config(eng) | {
                            "requests": len(sched.requests), "ops": n, "reps": cfg.full_reps,
                            "max_prompt": cfg.full_max_prompt, "max_output": cfg.full_max_output,
                            "trace_speed": cfg.trace_speed})
    res.speedup = sum(med["ref"]) / sum(med["cand"])
    res.speedup_ci95 = bootstrap_replays(runs["ref"], runs["cand"])
    dec = [k for k, op in enumerate(sched.ops) if op.kind == "decode"]
    dec_tokens = sum(len(sched.ops[k].reqs) for k in dec)
    if dec:
        res.step_ms = statistics.mean(med["cand"][k] for k in dec) * 1e3
        res.reference_step_ms = statistics.mean(med["ref"][k] for k in dec) * 1e3
        res.tokens_per_s = dec_tokens / sum(med["cand"][k] for k in dec)
        res.reference_tokens_per_s = dec_tokens / sum(med["ref"][k] for k in dec)
    mc, mr = user_metrics(sched, med["cand"], cfg.trace_speed), user_metrics(sched, med["ref"], cfg.trace_speed)
    res.requests = len(sched.requests)
    res.per_user_tps_p50, res.per_user_tps_p90 = mc["tps_p50"], mc["tps_p90"]
    res.ttft_ms_p50 = mc["ttft_p50"] * 1e3 if mc["ttft_p50"] is not None else None
    res.ttft_ms_p90 = mc["ttft_p90"] * 1e3 if mc["ttft_p90"] is not None else None
    res.throughput_tps, res.reference_throughput_tps = mc["throughput"], mr["throughput"]
    same = ties = 0
    for r_top, c_top in zip(toks["ref"], toks["cand"]):
        if torch.equal(r_top.indices[:, 0], c_top.indices[:, 0]):
            same += 1
        elif near_tie(r_top, c_top.indices[:, 0]):
            ties += 1
    res.tokens_match, res.near_ties = same / max(1, n), ties
    if same + ties < n:
        res.outputs_match = "differ"
        res.violations.append(f"greedy tokens differ from the reference's in {n - same} of {n} replay steps "
                              f"({ties} of them near ties)")
    else:
        res.outputs_match = "tokens" if same == n else "tokens-near-ties"
    res.experts_active = eng.fast_setup.experts_active
    if res.speedup > cfg.implausible_speedup:
        res.violations.append(f"implausible speedup {res.speedup:.1f}x")
    res.valid = not res.violations
    return res
