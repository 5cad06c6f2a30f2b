"""The Triton decode example's attention kernels alone, against the reference attention.

    python benchmarks/attn_check.py --device cuda [--shrink] [--settings '{"name": {KNOBS["attn"] overrides}}']

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set when unset):
minutes on the shrunk preset.

For each attention setting (KNOBS["attn"] overrides of examples/candidates/llama_triton_decode.py,
default: exact and online softmax, split and unsplit, with and without the fused RoPE) and
each decode position in --positions (batch 1, and batch 2 with two slots at other
positions), it fills one layer's cache with random keys and values, draws random qkv
split-K partials and runs the example's `_attention` (RoPE, this step's K/V write and
attention), then the same on a copy of the cache through the reference path (the example's
attention stage off: `common.apply_rope` and `common.attention`). Reports the largest
difference of the outputs relative to the reference's largest output, and of the written
K/V cells. A kernel bug shows as a relative error near 1; rounding as a few bf16 ulps
(about 1e-2). Prints a card, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.config import resolve_model, shrink as shrink_config  # noqa: E402
from engine_server.models.common import rope_tables  # noqa: E402
from engine_server.state import State, decode_batch, new_cache  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "candidates" / "llama_triton_decode.py"
SETTINGS = {
    "exact-split": {"EXACT_SOFTMAX": True, "NSPLIT": 16},
    "exact-1": {"EXACT_SOFTMAX": True, "NSPLIT": 1},
    "online-split": {"EXACT_SOFTMAX": False, "NSPLIT": 16},
    "online-1": {"EXACT_SOFTMAX": False, "NSPLIT": 1},
    "online-split-fuse": {"EXACT_SOFTMAX": False, "NSPLIT": 16, "FUSE_ROPE": True},
    "exact-split-fuse": {"EXACT_SOFTMAX": True, "NSPLIT": 16, "FUSE_ROPE": True},
}


def load_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tkcc_attn_check_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_state(model: str, shrink: bool, device: str, dtype, slots: int, max_seq: int) -> State:
    cfg, _ = resolve_model(model)
    if shrink:
        cfg = shrink_config(cfg)
    k, v = new_cache(cfg, slots, max_seq, dtype, device)
    tables = rope_tables(cfg, max_seq, dtype, device)
    return State(cfg, {}, k[:1], v[:1], tables, (0,))


def run_case(mod, state: State, knobs: dict, positions: list[int], slots: list[int], seed: int) -> dict:
    """One call of the example's attention against the reference path on the same inputs."""
    cfg, dev, dtype = state.config, state.device, state.dtype
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(seed)
    for c in state.k_cache + state.v_cache:
        c.copy_(torch.randn(c.shape, generator=g, device=dev, dtype=torch.float32).to(dtype))
    B = len(positions)
    qkv = torch.randn(2, B, (H + 2 * KV) * hd, generator=g, device=dev, dtype=torch.float32) * 0.5
    batch = decode_batch(torch.zeros(B, dtype=torch.long, device=dev),
                         torch.tensor(positions, device=dev), torch.tensor(slots, device=dev))
    pos, sl = batch.positions[:, -1], batch.slots
    cache = state.clone_cache()
    saved = copy.deepcopy(mod.KNOBS)
    try:
        mod.KNOBS["attn"].update(knobs)
        out = mod._attention(state, 0, qkv, batch, pos, sl)[0].float()  # (output, None) without sums
        got_k, got_v = state.k_cache[0].clone(), state.v_cache[0].clone()
        state.load_cache(*cache)
        mod.KNOBS["stages"]["attention"] = False
        ref = mod._attention(state, 0, qkv, batch, pos, sl)[0].float()
    finally:
        mod.KNOBS.clear()
        mod.KNOBS.update(saved)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    scale = ref.abs().max().item() or 1.0
    rel = ((out - ref).abs().max().item()) / scale
    kv = max((got_k.float() - state.k_cache[0].float()).abs().max().item(),
             (got_v.float() - state.v_cache[0].float()).abs().max().item())
    return {"positions": positions, "slots": slots, "rel_err": rel, "kv_max_diff": kv,
            "finite": bool(torch.isfinite(out).all())}


def check(model: str, shrink: bool, device: str, dtype, settings: dict, positions: list[int],
          max_seq: int) -> dict:
    mod = load_example()
    state = make_state(model, shrink, device, dtype, slots=4, max_seq=max_seq)
    rows = []
    for name, knobs in settings.items():
        t0 = time.perf_counter()
        cases = [run_case(mod, state, knobs, [p], [1], seed=p) for p in positions]
        cases += [run_case(mod, state, knobs, [p, max(0, p // 3)], [2, 0], seed=10_000 + p) for p in positions]
        worst = max(cases, key=lambda c: c["rel_err"])
        rows.append({"setting": name, "knobs": knobs, "worst_rel_err": worst["rel_err"], "worst_case": worst,
                     "kv_max_diff": max(c["kv_max_diff"] for c in cases),
                     "finite": all(c["finite"] for c in cases), "seconds": round(time.perf_counter() - t0, 2),
                     "cases": cases})
    return {"model": state.config.name, "device": device, "dtype": str(dtype), "head_dim": state.config.head_dim,
            "heads": state.config.num_heads, "kv_heads": state.config.num_kv_heads, "settings": rows}


def main() -> int:
    p = engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--settings", default="", help="JSON: name -> KNOBS['attn'] overrides (default: the built-in set)")
    p.add_argument("--positions", default="0,1,15,63,64,65,127,300,511,1023,2047")
    p.add_argument("--max-seq", type=int, default=2048)
    a = p.parse_args()
    if not a.device.startswith("cuda"):  # the example's kernels run on the CPU only under Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, a.dtype)
    settings = json.loads(a.settings) if a.settings else SETTINGS
    positions = [int(x) for x in a.positions.split(",") if int(x) < a.max_seq]
    res = check(a.model, a.shrink, a.device, dtype, settings, positions, a.max_seq)
    print(f"attention kernels vs reference: {res['model']} (head_dim {res['head_dim']}, "
          f"{res['heads']}/{res['kv_heads']} heads), {a.device}, {a.dtype}")
    for r in res["settings"]:
        w = r["worst_case"]
        print(f"  {r['setting']:<20} worst rel err {r['worst_rel_err']:.3g} at positions {w['positions']}"
              f"  K/V max diff {r['kv_max_diff']:.3g}  finite {r['finite']}")
    res["bench"] = "attn_check"
    return emit(res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
