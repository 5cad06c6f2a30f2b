"""Real prompts against uniform random tokens on the MoE presets: experts activated per decode
step and decode step time, same shapes, same weights, same cache layout.

    python benchmarks/moe_real_vs_random.py --shrink --device cpu \\
        --out benchmarks/results/cpu_moe_real_vs_random.json

For each model (qwen3-30b-a3b, mixtral-8x7b-v0.1) and batch size: B rows at one context
length (the trace's median prompt, capped by --max-ctx), prefilled by the reference forward
pass, then --steps decode steps whose next tokens come from the same stream (real text from
the prompt corpus, or `traffic.random_token_ids`: the labelled random comparison).
Experts active = distinct experts a decode step routes to, per layer (mean over layers and
steps), and the (layer, expert) weight sets it must read. Time: the decode steps of one side
per round, sides alternating, warm-up rounds dropped; the median over rounds, and the
median of paired per-round ratios random/real with a bootstrap 95% interval.

With --shrink the models are CPU-sized copies (`config.shrink`) and, by default, keep
their real expert count (`--experts real`; `--experts shrunk` keeps shrink's reduced count,
`both` runs the two). Weights are random-initialised (seeded): no checkpoint is fetched, so
routing reflects what the token ids and positions do to a random router, not a trained one.
Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from engine_server import traffic  # noqa: E402
from engine_server.config import resolve_model, shrink  # noqa: E402
from engine_server.measure import bootstrap_median  # noqa: E402
from engine_server.models import family  # noqa: E402
from engine_server.models.moe import experts_active  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.state import State, decode_batch, new_cache, prefill_batch  # noqa: E402
from engine_server.weights import init_weights  # noqa: E402


def build(model: str, do_shrink: bool, experts: str, device: str, max_slots: int, max_seq: int, seed: int):
    cfg, _ = resolve_model(model)
    real_experts = cfg.num_experts
    if do_shrink:
        cfg = shrink(cfg)
        if experts == "real":
            cfg = dataclasses.replace(cfg, num_experts=real_experts, name=f"{cfg.name} ({real_experts} experts)")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w = init_weights(cfg, seed, dtype, device)
    k, v = new_cache(cfg, max_slots, max_seq, dtype, device)
    fam = family(cfg)
    return State(cfg, w, k, v, fam.tables(cfg, w, max_seq, dtype, device), tuple(range(cfg.num_layers))), fam


def streams(kind: str, B: int, n: int, vocab: int, tok, prompts) -> list[list[int]]:
    if kind == "real":
        return [traffic.token_ids_for(n, tok, prompts, i) for i in range(B)]
    return [traffic.random_token_ids(n, vocab, seed=1000 + i) for i in range(B)]


def run_case(state, fam, B: int, ctx: int, steps: int, rounds: int, warmup: int, tok, prompts, device) -> dict:
    cfg = state.config
    sides = {}
    for s, kind in enumerate(("real", "random")):
        ids = torch.tensor(streams(kind, B, ctx + steps + 1, cfg.vocab_size, tok, prompts), device=device)
        slots = torch.arange(s * B, (s + 1) * B, device=device)
        with torch.inference_mode():
            for b in range(B):
                fam.forward(state, prefill_batch(ids[b:b + 1, :ctx], slots[b:b + 1]))
        batches = [decode_batch(ids[:, ctx + t], torch.full((B,), ctx + t, device=device), slots) for t in range(steps)]
        sides[kind] = batches
    snap = state.clone_cache()
    active = {}
    for kind, batches in sides.items():  # routing, once per side (the log costs host syncs: not timed)
        state.load_cache(*snap)
        per_step = []
        with torch.inference_mode():
            for b in batches:
                b.expert_log = []
                fam.forward(state, b)
                per_step.append(experts_active(b.expert_log))
                b.expert_log = None
        active[kind] = {"per_layer_mean": round(statistics.mean(x["mean_per_layer"] for x in per_step), 3),
                        "weight_sets_per_step": round(statistics.mean(x["total"] for x in per_step), 2)}
    times = {"real": [], "random": []}
    for r in range(warmup + rounds):
        for kind in (("real", "random") if r % 2 == 0 else ("random", "real")):
            state.load_cache(*snap)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                for b in sides[kind]:
                    fam.forward(state, b)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if r >= warmup:
                times[kind].append((time.perf_counter() - t) / steps)
    ratios = [a / b for a, b in zip(times["random"], times["real"])]
    mb = 3 * cfg.moe_intermediate_size * cfg.hidden_size * state.dtype.itemsize / 2**20  # one expert's weights
    return {"model": cfg.name, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "layers": cfg.num_layers, "batch": B, "context": ctx, "steps": steps,
            "experts_per_layer_real": active["real"]["per_layer_mean"],
            "experts_per_layer_random": active["random"]["per_layer_mean"],
            "expert_weight_mb_per_step_real": round(active["real"]["weight_sets_per_step"] * mb, 3),
            "expert_weight_mb_per_step_random": round(active["random"]["weight_sets_per_step"] * mb, 3),
            "step_ms_real": round(statistics.median(times["real"]) * 1e3, 4),
            "step_ms_random": round(statistics.median(times["random"]) * 1e3, 4),
            "random_over_real_time": round(statistics.median(ratios), 4),
            "random_over_real_time_ci95": [round(x, 4) for x in bootstrap_median(ratios)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b-v0.1")
    ap.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--experts", choices=["real", "shrunk", "both"], default="both",
                    help="with --shrink: keep the real expert count, shrink's reduced one, or run both")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--trace", default=str(traffic.DEFAULT_TRACE), help="its median prompt sets the context")
    ap.add_argument("--max-ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]
    prof = traffic.profile(traffic.read_trace(a.trace))
    ctx = max(1, min(int(prof.prompt_len.p50), a.max_ctx))
    variants = (["real", "shrunk"] if a.experts == "both" else [a.experts]) if a.shrink else ["real"]
    prompts = traffic.load_prompts()
    rows = []
    for model in a.models.split(","):
        for ex in variants:
            state, fam = build(model, a.shrink, ex, a.device, 2 * max(batches) + 1, ctx + a.steps + 2, a.seed)
            tok = traffic.load_tokenizer(None, state.config.vocab_size)
            for B in batches:
                rows.append(run_case(state, fam, B, ctx, a.steps, a.rounds, a.warmup, tok, prompts, a.device)
                            | {"preset": model, "expert_count": ex})
                r = rows[-1]
                print(f"  {r['model']:<42} B={B:<3} experts/layer real {r['experts_per_layer_real']:6.2f} "
                      f"random {r['experts_per_layer_random']:6.2f}   step real {r['step_ms_real']:8.3f} ms "
                      f"random {r['step_ms_random']:8.3f} ms", file=sys.stderr, flush=True)
    hw = hardware(a.device).model_dump()
    print(f"== MoE decode: real prompts vs uniform random tokens ({a.device}, torch {hw['torch']}, "
          f"{'shrunk, ' if a.shrink else ''}random-init weights; context {ctx} = trace P50 capped at {a.max_ctx}; "
          f"{a.steps} decode steps x {a.rounds} rounds)")
    head = (f"{'model':<42} {'E/k':>7} {'B':>3} {'exp/layer real':>14} {'random':>7} {'MB/step real':>12} "
            f"{'random':>7} {'ms real':>8} {'random':>8} {'rand/real time [95% CI]':>24}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ci = r["random_over_real_time_ci95"]
        print(f"{r['model']:<42} {str(r['experts']) + '/' + str(r['top_k']):>7} {r['batch']:>3} "
              f"{r['experts_per_layer_real']:>14.2f} {r['experts_per_layer_random']:>7.2f} "
              f"{r['expert_weight_mb_per_step_real']:>12.3f} {r['expert_weight_mb_per_step_random']:>7.3f} "
              f"{r['step_ms_real']:>8.3f} {r['step_ms_random']:>8.3f} "
              f"{r['random_over_real_time']:>8.3f} [{ci[0]:.3f}-{ci[1]:.3f}]")
    res = {"bench": "moe_real_vs_random", "device": a.device, "shrink": a.shrink, "context": ctx,
           "trace": Path(a.trace).name, "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup,
           "weights": f"random init, seed {a.seed}", "threads": a.threads if a.device == "cpu" else None,
           "rows": rows, "hardware": hw,
           "command": "python benchmarks/moe_real_vs_random.py " + " ".join(sys.argv[1:])}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
