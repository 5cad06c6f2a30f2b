"""Why the compiled baseline's greedy tokens part from the reference's: the first step's top
logits of the engine reference and of the gpt-fast-style decoder (benchmarks/baselines.py)
after forward_bench.py's prompt, the decoder in the model dtype, in float32 and with the math
SDPA backend.

    python benchmarks/baseline_tie_check.py --device cuda

A near tie (the float32 top two within two of the model dtype's steps at their size, so that
rounding alone may swap or merge them) explains a different first token without an error in
either. Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import baselines  # noqa: E402
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.results import hardware  # noqa: E402
from engine_server.state import prefill_batch  # noqa: E402


def top(logits: torch.Tensor, k: int = 3) -> dict:
    t = logits[0].float().topk(k)
    return {"values": [round(v, 4) for v in t.values.tolist()], "tokens": t.indices.tolist()}


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--context", type=int, default=512, help="prompt tokens (forward_bench.py's default)")
    a = p.parse_args()
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device))
    prompt = eng.traffic.tokens(a.context, 3)  # forward_bench.py's prompt
    dev = eng.device
    ids, pos = torch.tensor([prompt], device=dev), torch.arange(a.context, device=dev)
    max_seq = a.context + 320
    with torch.no_grad():
        rows = {"engine reference": top(eng.family.forward(eng.state, prefill_batch(ids, torch.tensor([0], device=dev))))}
        dec = baselines.Decoder(eng.model, max_seq).setup(eng.dtype, dev).load_hf(eng.state.weights).eval()
        rows[f"decoder {eng.dtype}"] = top(dec(ids, pos))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            rows[f"decoder {eng.dtype}, math SDPA"] = top(dec(ids, pos))
        w32 = {k: v.float() for k, v in eng.state.weights.items()}
        rows["decoder float32"] = top(baselines.Decoder(eng.model, max_seq).setup(torch.float32, dev).load_hf(w32).eval()(ids, pos))
    hi = rows["decoder float32"]["values"][0]
    step = torch.finfo(eng.dtype).eps * 2.0 ** math.floor(math.log2(abs(hi)))  # the dtype's spacing at hi
    gap = hi - rows["decoder float32"]["values"][1]
    print(f"== first-step top logits after the {a.context}-token prompt, {a.model} {eng.dtype} on {a.device}")
    for name, r in rows.items():
        print(f"  {name:34s} {r['values']}  tokens {r['tokens']}")
    print(f"float32 top two {gap:.4f} apart; {eng.dtype}'s step at {hi:.2f}: {step:g} -> "
          f"{'a near tie' if gap < 2 * step else 'not a tie'}")
    res = {"bench": "baseline_tie_check", "model": a.model, "shrink": a.shrink, "device": a.device,
           "dtype": str(eng.dtype), "context": a.context, "rows": rows, "float32_gap": round(gap, 4),
           "dtype_step": step, "near_tie": gap < 2 * step, "hardware": hardware(a.device).model_dump()}
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
