"""Traffic profiles of a window, and drift between the live window and the profile the serving
forward pass was tuned on.

    p = profile_file("serving.jsonl")                # any trace format traffic.read_trace reads
    q = profile_records(service.log.window(64))      # the live window, from memory
    d = drift(p, q, DriftConfig())                   # d.drifted, d.reasons, the distances

A `Profile` holds: request count, duration and arrival rate; prompt and output length
quantiles; a sorted sketch of log2(1 + length) (every value up to `SKETCH` requests, else
`SKETCH` evenly spaced quantiles); concurrency, i.e. the requests in flight at each arrival
(measured from `finish_s` in a serving log, else estimated with the same assumed speeds as
`traffic.profile`), its mean and its mix over batch buckets; and for MoE serving logs the
routing histogram over experts (normalised).

Distances (`drift`), for prompt and output lengths each:
* `ks`: Kolmogorov-Smirnov distance of the length distributions (0..1);
* `w1_log2`: Wasserstein-1 distance of log2(1 + length), i.e. by how many doublings a typical
  request moved (normalised log lengths: a 2x change of every length is 1.0);
* `p50_shift`, `p90_shift`: relative change of the median and the P90 (b / a - 1).
Also `experts_js` (Jensen-Shannon divergence of the expert histograms, bits, 0..1), and
`rate_log2`, `concurrency_log2` (log2 of the ratios).

The verdict (thresholds in `DriftConfig`): a length distribution drifted when its change is
significant (KS above both `ks_max` and the two-sample KS critical value at 1% for the two
windows' sizes, so a small window's noise is not drift) and material (W1 above `w1_max` or
|P90 shift| above `p90_shift_max`). Experts drift above `js_max`; arrival rate and
concurrency only gate when their thresholds are set (> 0). A window with fewer than
`min_requests` requests is never called drifted.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from engine_server.traffic import LengthStats, _stats, read_trace

SKETCH = 256
BATCH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 10**9))


@dataclass
class DriftConfig:
    """Thresholds of the drift verdict (`tkcc traffic diff` and `tkcc serve --continual` flags)."""
    min_requests: int = 32  # windows smaller than this are never called drifted
    ks_max: float = 0.2  # KS distance of prompt or output lengths (and above the 1% critical value)
    w1_max: float = 0.5  # Wasserstein-1 of log2(1 + length): doublings
    p90_shift_max: float = 0.5  # |P90 b / P90 a - 1|
    js_max: float = 0.05  # Jensen-Shannon divergence of MoE expert histograms (bits)
    rate_shift_max: float = 0.0  # |log2 arrival-rate ratio|; 0: not gating
    concurrency_shift_max: float = 0.0  # |log2 mean-concurrency ratio|; 0: not gating


class Profile(BaseModel):
    source: str
    format: str
    requests: int
    duration_s: float
    arrival_rate: float
    prompt_len: LengthStats
    output_len: LengthStats
    prompt_log2: list[float]  # sorted sketch of log2(1 + prompt_len)
    output_log2: list[float]
    concurrency: float  # mean requests in flight at an arrival
    concurrency_measured: bool  # from finish times (a serving log), else Little's-law style estimate
    batch_mix: dict[str, float]  # share of arrivals by requests in flight: "1", "2", "3-4", ...
    experts: list[float] | None = None  # normalised routing histogram (MoE serving logs)
    expert_tokens: int = 0

    def summary(self) -> str:
        def lens(s: LengthStats) -> str:
            return (f"p10 {s.p10:.0f}  p50 {s.p50:.0f}  p90 {s.p90:.0f}  p99 {s.p99:.0f}  "
                    f"mean {s.mean:.1f}  max {s.max}")
        mix = ", ".join(f"{k}: {v:.0%}" for k, v in self.batch_mix.items() if v > 0)
        lines = [f"{self.source} ({self.format}): {self.requests} requests over {self.duration_s:.1f} s "
                 f"({self.arrival_rate:.2f} req/s)",
                 f"  prompt tokens  {lens(self.prompt_len)}",
                 f"  output tokens  {lens(self.output_len)}",
                 f"  concurrency    mean {self.concurrency:.2f} "
                 f"({'measured' if self.concurrency_measured else 'estimated'}); in flight at arrival: {mix}"]
        if self.experts:
            top = sorted(range(len(self.experts)), key=lambda i: -self.experts[i])[:4]
            lines.append(f"  experts        {len(self.experts)} experts, {self.expert_tokens} routings; top: "
                         + ", ".join(f"e{i} {self.experts[i]:.1%}" for i in top))
        return "\n".join(lines)


def _sketch(xs: list[int]) -> list[float]:
    v = sorted(math.log2(1 + x) for x in xs)
    if len(v) <= SKETCH:
        return [round(x, 5) for x in v]
    return [round(_quantile(v, (i + 0.5) / SKETCH), 5) for i in range(SKETCH)]


def _quantile(v: list[float], p: float) -> float:
    pos = p * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def _in_flight(arrivals: list[float], ends: list[float]) -> list[int]:
    """Requests in flight at each arrival (itself included); inputs sorted by arrival."""
    heap, out = [], []
    for a, e in zip(arrivals, ends):
        while heap and heap[0] <= a:
            heapq.heappop(heap)
        heapq.heappush(heap, max(e, a))
        out.append(len(heap))
    return out


def profile_requests(rows: list[dict], source: str, fmt: str, decode_tok_s: float = 50.0,
                     prefill_tok_s: float = 5000.0) -> Profile:
    """rows: dicts with arrival_s, prompt_len, output_len and optionally finish_s, experts."""
    if not rows:
        raise ValueError("empty window")
    rows = sorted(rows, key=lambda r: r["arrival_s"])
    t0 = rows[0]["arrival_s"]
    arr = [r["arrival_s"] - t0 for r in rows]
    P, O = [int(r["prompt_len"]) for r in rows], [int(r["output_len"]) for r in rows]
    measured = all(r.get("finish_s") is not None for r in rows)
    ends = ([r["finish_s"] - t0 for r in rows] if measured else
            [a + p / prefill_tok_s + o / decode_tok_s for a, p, o in zip(arr, P, O)])
    flight = _in_flight(arr, ends)
    mix = {(f"{lo}" if lo == hi else f"{lo}+" if hi > 10**8 else f"{lo}-{hi}"):
           round(sum(lo <= f <= hi for f in flight) / len(flight), 4) for lo, hi in BATCH_BUCKETS}
    hists = [r["experts"] for r in rows if r.get("experts")]
    experts, tokens = None, 0
    if hists:
        tot = [sum(col) for col in zip(*hists)]
        tokens = sum(tot)
        experts = [round(x / tokens, 6) for x in tot] if tokens else None
    duration = arr[-1]
    return Profile(source=source, format=fmt, requests=len(rows), duration_s=round(duration, 6),
                   arrival_rate=len(rows) / duration if duration > 0 else 0.0,
                   prompt_len=_stats(P), output_len=_stats(O), prompt_log2=_sketch(P), output_log2=_sketch(O),
                   concurrency=round(sum(flight) / len(flight), 4), concurrency_measured=measured,
                   batch_mix=mix, experts=experts, expert_tokens=tokens)


def profile_records(records: list[dict], source: str = "live window") -> Profile:
    """Profile of serving-log records held in memory (`ServingLog.window`)."""
    return profile_requests(records, source, "serving_log")


def profile_file(path: str | Path, limit: int | None = None) -> Profile:
    """Profile of a trace file in any format `traffic.read_trace` reads; a serving log's
    extra fields (finish_s, experts) are used when present."""
    trace = read_trace(path, limit)
    if trace.format == "serving_log":
        rows = []
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
                    if limit is not None and len(rows) >= limit:
                        break
        return profile_requests(rows, str(path), trace.format)
    rows = [{"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
            for r in trace.requests]
    return profile_requests(rows, str(path), trace.format)


# ---- distances ---------------------------------------------------------------------------------

def ks(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov distance of sorted samples (sketches)."""
    i = j = 0
    d = 0.0
    while i < len(a) and j < len(b):
        x = min(a[i], b[j])
        while i < len(a) and a[i] <= x:
            i += 1
        while j < len(b) and b[j] <= x:
            j += 1
        d = max(d, abs(i / len(a) - j / len(b)))
    return d


def w1(a: list[float], b: list[float], grid: int = 1000) -> float:
    """Wasserstein-1 of two sorted samples: the mean |quantile difference| over (0, 1)."""
    def q(v, u):
        return v[min(len(v) - 1, int(u * len(v)))]
    return sum(abs(q(a, (k + 0.5) / grid) - q(b, (k + 0.5) / grid)) for k in range(grid)) / grid


def js(p: list[float], q: list[float]) -> float:
    """Jensen-Shannon divergence in bits (0: same, 1: disjoint)."""
    sp, sq = sum(p) or 1.0, sum(q) or 1.0
    p, q = [x / sp for x in p], [x / sq for x in q]

    def kl(x, m):
        return sum(xi * math.log2(xi / mi) for xi, mi in zip(x, m) if xi > 0)
    m = [(x + y) / 2 for x, y in zip(p, q)]
    return max(0.0, 0.5 * kl(p, m) + 0.5 * kl(q, m))


def ks_critical(n: int, m: int, c: float = 1.63) -> float:
    """Two-sample KS critical value at alpha = 1% (c = 1.63) for sample sizes n and m."""
    return c * math.sqrt((n + m) / (n * m))


class LengthDrift(BaseModel):
    ks: float
    ks_limit: float
    w1_log2: float
    p50_shift: float
    p90_shift: float
    drifted: bool


class Drift(BaseModel):
    a: str
    b: str
    requests: list[int]
    prompt: LengthDrift
    output: LengthDrift
    experts_js: float | None = None
    rate_log2: float | None = None
    concurrency_log2: float | None = None
    drifted: bool
    reasons: list[str]
    thresholds: dict

    def summary(self) -> str:
        def line(name: str, d: LengthDrift) -> str:
            return (f"  {name:<7} KS {d.ks:.3f} (limit {d.ks_limit:.3f})  W1 {d.w1_log2:.2f} doublings  "
                    f"P50 {d.p50_shift:+.0%}  P90 {d.p90_shift:+.0%}  {'DRIFT' if d.drifted else 'same'}")
        ex = "n/a" if self.experts_js is None else f"{self.experts_js:.4f} bits"
        rate = "n/a" if self.rate_log2 is None else f"{self.rate_log2:+.2f}"
        conc = "n/a" if self.concurrency_log2 is None else f"{self.concurrency_log2:+.2f}"
        return "\n".join([f"A: {self.a} ({self.requests[0]} requests)", f"B: {self.b} ({self.requests[1]} requests)",
                          line("prompt", self.prompt), line("output", self.output),
                          f"  experts JS {ex}; arrival rate log2 ratio {rate}; concurrency log2 ratio {conc}",
                          "verdict: " + ("DRIFTED: " + "; ".join(self.reasons) if self.drifted
                                         else "no drift" + (f" ({'; '.join(self.reasons)})" if self.reasons else ""))])


def _shift(a: float, b: float) -> float:
    return (b + 1) / (a + 1) - 1  # +1: zero-length quantiles stay finite


def _log2_ratio(a: float, b: float) -> float | None:
    return math.log2(b / a) if a > 0 and b > 0 else None


def drift(a: Profile, b: Profile, cfg: DriftConfig | None = None) -> Drift:
    """Distances from profile `a` (tuned on) to `b` (live) and the verdict."""
    cfg = cfg or DriftConfig()
    limit = max(cfg.ks_max, ks_critical(a.requests, b.requests))

    def lengths(qa, qb, sa: LengthStats, sb: LengthStats) -> LengthDrift:
        k, w = ks(qa, qb), w1(qa, qb)
        p90 = _shift(sa.p90, sb.p90)
        return LengthDrift(ks=round(k, 4), ks_limit=round(limit, 4), w1_log2=round(w, 4),
                           p50_shift=round(_shift(sa.p50, sb.p50), 4), p90_shift=round(p90, 4),
                           drifted=k > limit and (w > cfg.w1_max or abs(p90) > cfg.p90_shift_max))
    dp = lengths(a.prompt_log2, b.prompt_log2, a.prompt_len, b.prompt_len)
    do = lengths(a.output_log2, b.output_log2, a.output_len, b.output_len)
    reasons = [f"{n} lengths (KS {d.ks:.2f} > {d.ks_limit:.2f}, W1 {d.w1_log2:.2f} doublings, "
               f"P90 {d.p90_shift:+.0%})" for n, d in (("prompt", dp), ("output", do)) if d.drifted]
    ex = js(a.experts, b.experts) if a.experts and b.experts and len(a.experts) == len(b.experts) else None
    if ex is not None and ex > cfg.js_max:
        reasons.append(f"expert routing (JS {ex:.3f} > {cfg.js_max:g} bits)")
    rate = _log2_ratio(a.arrival_rate, b.arrival_rate)
    if cfg.rate_shift_max > 0 and rate is not None and abs(rate) > cfg.rate_shift_max:
        reasons.append(f"arrival rate (log2 ratio {rate:+.2f})")
    conc = _log2_ratio(a.concurrency, b.concurrency)
    if cfg.concurrency_shift_max > 0 and conc is not None and abs(conc) > cfg.concurrency_shift_max:
        reasons.append(f"concurrency (log2 ratio {conc:+.2f})")
    drifted = bool(reasons)
    if min(a.requests, b.requests) < cfg.min_requests:
        drifted = False
        reasons = [f"window too small ({min(a.requests, b.requests)} < {cfg.min_requests} requests)"] + reasons
    return Drift(a=a.source, b=b.source, requests=[a.requests, b.requests], prompt=dp, output=do,
                 experts_js=None if ex is None else round(ex, 5), rate_log2=None if rate is None else round(rate, 4),
                 concurrency_log2=None if conc is None else round(conc, 4), drifted=drifted, reasons=reasons,
                 thresholds=cfg.__dict__.copy())


# ---- command line: tkcc traffic profile FILE | diff A B ----------------------------------------

def add_parser(sub, add_dataclass_args) -> None:
    p = sub.add_parser("traffic", help="profile a trace or serving log; drift between two")
    acts = p.add_subparsers(dest="traffic_cmd", required=True)
    pr = acts.add_parser("profile", help="a human summary, then one JSON line")
    pr.add_argument("file")
    pr.add_argument("--limit", type=int, default=None, help="the first N requests of the file")
    df = acts.add_parser("diff", help="drift from A (tuned on) to B (live): a summary, then one JSON line")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--limit", type=int, default=None, help="the first N requests of each file")
    add_dataclass_args(df, DriftConfig)


def main(args) -> int:
    from tkcc_mcp.cli import config_from
    if args.traffic_cmd == "profile":
        p = profile_file(args.file, args.limit)
        print(p.summary())
        print(json.dumps(p.model_dump()), flush=True)
        return 0
    a, b = profile_file(args.a, args.limit), profile_file(args.b, args.limit)
    d = drift(a, b, config_from(args, DriftConfig))
    print(d.summary())
    print(json.dumps(d.model_dump()), flush=True)
    return 0
