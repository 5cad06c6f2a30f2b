"""Tier fidelity: do fast-tier speedups rank candidates as the full tier does?

Installs ~20 distinct candidates on one live engine: the offline agent's move combinations,
hand-written variants that add work per layer, per forward pass, in prefill only or in
batched decode steps only (each one a way a cheaper tier can misjudge the full replay), and
any candidate files given, with `--variants N` single-knob variants of the first file's
KNOBS (as the hill-climb of forward_bench.py makes them); measures each on both tiers and reports
the Spearman rank correlation of their speedups.

    python benchmarks/fidelity_bench.py --device cuda [--full-requests 12] [--variants 6] [examples/candidates/*.py]

`--also-fast '{"name": {EngineConfig field: value}}'` measures each candidate's fast tier
again under each of those settings (alternating which goes first) and reports how its
speedups rank against the default's and what each costs: how a cheaper stopping rule is
judged against the one whose fidelity was measured. `--no-full` skips the full tier.

Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args  # noqa: E402
from benchmarks.forward_bench import find_knobs, leaves, neighbours, rewrite_knobs, with_value  # noqa: E402
from engine_server.engine import Engine, EngineConfig, fast_layers  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from tkcc_mcp.agents import moves as M  # noqa: E402

LAYER_WORK = '''
import torch.nn.functional as F
from engine_server.models import llama as ref
_mlp = ref.mlp


def _slow_mlp(state, layer, x, batch):
    for _ in range({k}):  # extra work in every layer the pass runs
        F.linear(x, state.weights[f"model.layers.{{layer}}.mlp.down_proj.weight"].t())
    return _mlp(state, layer, x, batch)


def forward(state, batch):
    return ref.forward(state, batch, mlp=_slow_mlp)
'''

FORWARD_WORK = '''
import torch.nn.functional as F
from engine_server.models import llama as ref
from engine_server.models.common import lm_head_weight


def forward(state, batch):
    x = F.embedding(batch.tokens[:, -1:], state.weights["model.embed_tokens.weight"])
    for _ in range({k}):  # extra work once per forward pass, whatever the layers
        F.linear(x, lm_head_weight(state))
    return ref.forward(state, batch)
'''

PREFILL_WORK = '''
import torch.nn.functional as F
from engine_server.models import llama as ref
from engine_server.models.common import lm_head_weight


def forward(state, batch):
    if batch.seq_len > 1:  # extra work in prefill only: the fast tier times decode steps
        x = F.embedding(batch.tokens, state.weights["model.embed_tokens.weight"])
        for _ in range({k}):
            F.linear(x, lm_head_weight(state))
    return ref.forward(state, batch)
'''


BATCH_WORK = '''
import torch.nn.functional as F
from engine_server.models import llama as ref
from engine_server.models.common import lm_head_weight


def forward(state, batch):
    if batch.size > 1 and batch.seq_len == 1:  # extra work in batched decode steps only
        x = F.embedding(batch.tokens, state.weights["model.embed_tokens.weight"])
        for _ in range({k}):
            F.linear(x, lm_head_weight(state))
    return ref.forward(state, batch)
'''


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):  # average ranks of ties
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def candidates(device: str, n_moves: int) -> list[tuple[str, str]]:
    src = M.load_sources("llama")
    ok = M.applicable("llama", src, device)
    out = []
    for r in range(1, len(ok) + 1):
        for combo in itertools.combinations(ok, r):
            out.append((M.apply(M.Spec("llama"), combo).name, M.render(M.apply(M.Spec("llama"), combo), src)))
    out = out[:: max(1, len(out) // n_moves)][:n_moves]
    out += [(f"layer-work-{k}", LAYER_WORK.format(k=k)) for k in (1, 2, 3, 4, 6)]
    out += [(f"forward-work-{k}", FORWARD_WORK.format(k=k)) for k in (1, 2, 4, 8)]
    out += [(f"prefill-work-{k}", PREFILL_WORK.format(k=k)) for k in (1, 2, 4, 8)]
    out += [(f"batch-work-{k}", BATCH_WORK.format(k=k)) for k in (2, 8)]
    return out


def knob_variants(name: str, source: str, n: int) -> list[tuple[str, str]]:
    """Up to n variants of `source`, each one KNOBS leaf (spread over all of them) moved to
    its first neighbour."""
    found = find_knobs(source)
    if not found or n <= 0:
        return []
    knobs, span = found
    out = []
    every = leaves(knobs)
    for path, value in every[::max(1, len(every) // n)][:n]:
        v = neighbours(value)[0]
        out.append((f"{name}[{'.'.join(map(str, path))}={v}]", rewrite_knobs(source, span, with_value(knobs, path, v))))
    return out


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--moves", type=int, default=9, help="move combinations among the candidates")
    p.add_argument("--full-requests", type=int, default=0, help="full-tier requests (0: the engine default)")
    p.add_argument("--variants", type=int, default=0, help="single-knob variants of the first file's KNOBS")
    p.add_argument("--also-fast", default="{}", help="JSON: setting name -> EngineConfig overrides")
    p.add_argument("--no-full", action="store_true", help="fast tier only (with --also-fast)")
    p.add_argument("files", nargs="*", help="more candidates: forward-pass files (e.g. examples/candidates/*.py)")
    a = p.parse_args()
    settings = json.loads(a.also_fast)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for k, v in settings.items():
        if not set(v) <= known:
            p.error(f"--also-fast {k}: not EngineConfig fields: {sorted(set(v) - known)}")
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device, full_requests=a.full_requests))
    rows = []
    t0 = time.perf_counter()
    extra = [(Path(f).stem, Path(f).read_text()) for f in a.files]
    extra += [v for name, src in extra[:1] for v in knob_variants(name, src, a.variants)]
    for name, src in candidates(a.device, a.moves) + extra:
        r = eng.submit_forward_pass(src, name=name)
        if not r.ok:
            print(f"{name}: install failed: {r.error.message[:200]}")
            continue
        also = {}
        order = [None, *settings] if len(rows) % 2 == 0 else [*settings, None]
        for setting in order:
            with overrides(eng, settings.get(setting, {})):
                m = eng.measure_fast(r.candidate_id)
            if setting is None:
                fm = m
            else:
                also[setting] = {"fast": m.speedup, "fast_ci95": m.speedup_ci95, "fast_s": m.seconds,
                                 "fast_rounds": m.samples, "fast_phases_s": m.config.get("phases_s")}
        full = None if a.no_full else eng.measure_full(r.candidate_id)
        rows.append({"name": name, "fast": fm.speedup, "fast_ci95": fm.speedup_ci95,
                     "full": full.speedup if full else None, "full_ci95": full.speedup_ci95 if full else None,
                     "fast_s": fm.seconds, "full_s": full.seconds if full else None,
                     "fast_rounds": fm.samples, "fast_phases_s": fm.config.get("phases_s"), "also_fast": also,
                     # every candidate here is honest: a tier that flags one is wrong about it
                     "fast_valid": fm.valid, "full_valid": full.valid if full else None,
                     "violations": fm.violations + (full.violations if full else [])})
        print(f"{name:>60}: fast x{fm.speedup:.3f}" + (f"  full x{full.speedup:.3f}" if full else "")
              + "".join(f"  {k} x{v['fast']:.3f}" for k, v in also.items()))
        eng.remove(r.candidate_id)
    res = {"bench": "fidelity", "model": eng.model.name, "device": a.device, "candidates": len(rows),
           "fast_config": {k: v for k, v in dataclasses.asdict(eng.config).items() if k.startswith("fast_")},
           "fast_s_mean": statistics.mean(r["fast_s"] for r in rows), "rows": rows}
    if not a.no_full:
        res["spearman"] = spearman([r["fast"] for r in rows], [r["full"] for r in rows])
        res["full_s_mean"] = statistics.mean(r["full_s"] for r in rows)
        print(f"Spearman rank correlation, fast vs full tier, {len(rows)} candidates: {res['spearman']:.3f}; "
              f"fast tier {res['fast_s_mean']:.2f} s, full tier {res['full_s_mean']:.2f} s a call")
    res["flagged"] = [r["name"] for r in rows if not r["fast_valid"] or r["full_valid"] is False]
    print(f"candidates a tier flagged (all are honest): {len(res['flagged'])} of {len(rows)}"
          + (f": {', '.join(res['flagged'])}" if res["flagged"] else ""))
    res["also_fast"] = {}
    for k in settings:
        other = [r["also_fast"][k]["fast"] for r in rows]
        summary = {"overrides": settings[k], "spearman_vs_default_fast": spearman([r["fast"] for r in rows], other),
                   "max_abs_diff_vs_default_fast": max(abs(r["fast"] - o) for r, o in zip(rows, other)),
                   "fast_s_mean": statistics.mean(r["also_fast"][k]["fast_s"] for r in rows),
                   "rounds_mean": statistics.mean(r["also_fast"][k]["fast_rounds"] for r in rows)}
        if not a.no_full:
            summary["spearman_vs_full"] = spearman(other, [r["full"] for r in rows])
        res["also_fast"][k] = summary
        print(f"fast tier with {k} {settings[k]}: Spearman {summary['spearman_vs_default_fast']:.3f} against the "
              f"default's speedups (max |diff| {summary['max_abs_diff_vs_default_fast']:.4f}), "
              f"{summary['fast_s_mean']:.2f} s a call against {res['fast_s_mean']:.2f} s, "
              f"{summary['rounds_mean']:.1f} rounds against {statistics.mean(r['fast_rounds'] for r in rows):.1f}")
    res.update(seconds=time.perf_counter() - t0, hardware=hardware(str(eng.device)).model_dump())
    return emit(res, a.out)


@contextlib.contextmanager
def overrides(eng: Engine, fields: dict):
    """The engine's (resolved) config with these fields changed, for the block only
    (fast_fraction and fast_min_layers too, on the CPU: the fast layers follow them; on CUDA the
    candidates' graphs were captured for the engine's own)."""
    saved = {k: getattr(eng.config, k) for k in fields}
    layers = eng.fast_layers
    depth = {"fast_fraction", "fast_min_layers"} & fields.keys()
    if depth and eng.cuda:
        raise SystemExit(f"--also-fast: {', '.join(sorted(depth))} can change only on the CPU (graphs are captured "
                         "per depth)")
    try:
        for k, v in fields.items():
            setattr(eng.config, k, v)
        if depth:
            eng.fast_layers = fast_layers(len(eng.state.layers), eng.config.fast_fraction, eng.config.fast_min_layers)
        yield
    finally:
        for k, v in saved.items():
            setattr(eng.config, k, v)
        eng.fast_layers = layers


if __name__ == "__main__":
    sys.exit(main())
