"""The example candidates in examples/candidates/.

1. Each installs in the CPU engine (the `llama_engine` fixture) and is bitwise exact there:
   on the CPU without the Triton interpreter their decode path falls back to the reference.
2. The ladder files and the H200 winner are what make_ladder.py writes from llama_triton_decode.py.
3. With `triton` importable, the Triton decode path itself runs under the Triton
   interpreter (TRITON_INTERPRET=1, in a subprocess: it must be set before triton is
   imported) on CPU tensors of a shrunk Llama, float32 and bfloat16, against the reference:
   logits close with the same argmax, the K/V cells the step owns close, every other cache
   cell untouched, the weights untouched; for B in {1, 3} rows of different context lengths,
   a subset of the layers and zero layers, and knob variants that reach every kernel branch
   (sequence splits with an empty split, online and exact softmax, split-K with a ragged
   last split, tl.dot and FMA GEMV paths, the FMA path reduced at every step, K loops
   software-pipelined by Triton (LOOP_STAGES), the ladder's
   stages, weights and the first K/V block loaded before the PDL wait).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "candidates"
CANDIDATES = sorted(p for p in EXAMPLES.glob("*.py") if "\ndef forward(" in p.read_text())
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def test_examples_exist():
    names = {p.name for p in CANDIDATES}
    assert {"llama_triton_decode.py", "llama_triton_attention.py", "llama_triton_attn_norm.py",
            "llama_triton_decode_h200.py"} <= names


@pytest.mark.parametrize("path", CANDIDATES, ids=lambda p: p.stem)
def test_installs_and_is_bitwise_on_cpu(llama_engine, path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = llama_engine.submit_forward_pass(path.read_text(), name=path.stem)
    assert r.ok, r.error
    ex = llama_engine.check_bit_exact(r.candidate_id)
    assert ex.exact, ex
    tol = llama_engine.check_bit_exact(r.candidate_id, mode="tolerance")
    assert tol.close and tol.tokens_equal, tol


def test_ladder_files_are_current():
    spec = importlib.util.spec_from_file_location("make_ladder", EXAMPLES / "make_ladder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in [*mod.LADDER, *mod.WINNERS]:
        assert (EXAMPLES / name).read_text() == mod.render(name), f"{name} is stale: run make_ladder.py"
    winner = (EXAMPLES / "llama_triton_decode_h200.py").read_text()
    assert '"EXACT_SOFTMAX": False, "FUSE_ROPE": True' in winner and '"PREFETCH_O": False' in winner
    assert '"combine": {"num_warps": 1, "EARLY_TRIGGER": True,' in winner and '"num_stages": 1, "PRELOAD_KV"' in winner
    assert '"norm": {"num_warps": 32, "EARLY_TRIGGER": True, "FOLD": True}' in winner
    assert '"qkv": {"BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 1,' in winner


# ---- the Triton kernels under the interpreter ------------------------------------------

INTERPRETER_SCRIPT = r'''
import hashlib, json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
from engine_server.candidate import load_module
from engine_server.config import resolve_model, shrink
from engine_server.models import llama as ref
from engine_server.state import State, decode_batch, new_cache, prefill_batch
from engine_server.weights import init_weights

dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[sys.argv[2]]
source = open(sys.argv[1]).read()
cases = json.loads(sys.argv[3])
torch.manual_seed(0)
cfg = shrink(resolve_model("llama-3.2-1b")[0])
weights = init_weights(cfg, 0, dtype, "cpu")
MAX_SEQ, SLOTS = 64, 5  # slot 4: the padding slot, never used by these batches
tables = ref.tables(cfg, weights, MAX_SEQ, dtype, "cpu")
k, v = new_cache(cfg, SLOTS, MAX_SEQ, dtype, "cpu")
g = torch.Generator().manual_seed(1)
for t in k + v:  # noise in every cell, as the exactness check fills the cache
    t.copy_(torch.randn(t.shape, generator=g) * 100)
base = State(cfg, weights, k, v, tables, tuple(range(cfg.num_layers)))
LENS = [5, 40, 23]  # cached tokens of slots 0, 1, 2
for slot, n in enumerate(LENS):
    ref.forward(base, prefill_batch(torch.randint(0, cfg.vocab_size, (1, n), generator=g), torch.tensor([slot])))
pristine = {name: t.clone() for name, t in weights.items()}

def step(fwd, rows, layers, prepare=None, boost=None):
    st = State(cfg, weights, [t.clone() for t in k], [t.clone() for t in v], tables, layers)
    if boost:  # key 3 of every slot scaled in the case's layers: scores far above the step's own key's
        for i in layers:
            st.k_cache[i][:, :, 3] *= boost
    if prepare is not None:  # as the engine does at install
        prepare(st)
    slots = torch.tensor([2, 0, 1][:rows])  # rows in another order than their slots
    lens = torch.tensor([LENS[s] for s in slots.tolist()])
    out = fwd(st, decode_batch(torch.tensor([7, 11, 13][:rows]), lens, slots))
    return out, st, slots, lens

import time
results = []
for case in cases:
    t0 = time.perf_counter()
    mod = load_module("interp_" + str(len(results)), source)
    apply_knobs(mod.KNOBS, case.get("knobs", {}))
    layers = tuple(case["layers"]) if case.get("layers") is not None else base.layers
    r, rs, slots, lens = step(ref.forward, case["rows"], layers, boost=case.get("boost"))
    c, cs, _, _ = step(mod.forward, case["rows"], layers, getattr(mod, "prepare", None), boost=case.get("boost"))
    owned = torch.zeros(SLOTS, MAX_SEQ, dtype=torch.bool)
    owned[slots, lens] = True
    kv_owned, kv_outside, kv_ref = 0.0, 0.0, 0.0
    for a, b in zip(rs.k_cache + rs.v_cache, cs.k_cache + cs.v_cache):
        d = (a.float() - b.float()).abs().amax(dim=(1, 3))  # [slots, positions]
        kv_owned = max(kv_owned, d[owned].max().item())
        kv_outside = max(kv_outside, d[~owned].max().item())
        kv_ref = max(kv_ref, a.float().abs().amax(dim=(1, 3))[owned].max().item())
    results.append(dict(
        case=case, shape=list(c.shape), dtype=str(c.dtype),
        max_diff=(r.float() - c.float()).abs().max().item(), max_ref=r.float().abs().max().item(),
        bitwise=bool(torch.equal(r, c)), allclose=bool(torch.allclose(c.float(), r.float(), 1e-2, 1e-2)),
        argmax_equal=bool(torch.equal(r.argmax(-1), c.argmax(-1))),
        kv_owned_diff=kv_owned, kv_outside_diff=kv_outside, kv_owned_ref=kv_ref,
        prepared=sorted(cs.scratch), layers=list(layers),
        digest=hashlib.sha256(b"".join(t.float().numpy().tobytes() for t in [c] + cs.k_cache + cs.v_cache)).hexdigest(),
        seconds=time.perf_counter() - t0, exact_softmax=bool(mod.KNOBS["attn"]["EXACT_SOFTMAX"]),
        weights_untouched=all(torch.equal(weights[n], t) for n, t in pristine.items()),
        used_triton=mod._supported(cs, decode_batch(torch.tensor([1]), torch.tensor([1]), torch.tensor([0])))))
print("RESULTS " + json.dumps(results))
'''

SPLITS = {"NSPLIT": 4, "BLOCK_S": 16}  # ctx 41 -> 3 splits busy, 1 empty
ONLINE, EXACT = {"EXACT_SOFTMAX": False}, {"EXACT_SOFTMAX": True}
NOFUSE = {"FUSE_ROPE": False}  # RoPE and the K/V write in _rope_kv_kernel, not in attention
PRE_KV = {"PRELOAD_KV": True}  # each split's first K/V block loaded before the (PDL) wait
EARLY = {"EARLY_INPUTS": True}  # position, slot and RoPE rows loaded before the (PDL) wait
PIPE = {"PIPE": True}  # a GEMV's K steps loaded one step ahead
FOLD = {"norm": {"FOLD": True}}  # batch 1: the norms folded into the GEMVs, a float32 residual
IN_O = {"IN_O": True}  # KNOBS["combine"]: the splits add into sums o_proj divides; no combine kernel
BF16_CASES = [
    {"rows": 1},
    {"rows": 3},
    {"rows": 3, "layers": []},
    {"rows": 2, "layers": [1, 3], "knobs": {"attn": SPLITS | EXACT | NOFUSE}},
    {"rows": 2, "layers": [2], "knobs": {"attn": SPLITS | ONLINE | NOFUSE}},
    {"rows": 2, "layers": [2], "knobs": {"attn": {"NSPLIT": 1, "BLOCK_S": 16} | ONLINE}},
    {"rows": 1, "layers": [0], "knobs": {"attn": {"NSPLIT": 1, "BLOCK_S": 16} | EXACT, "gemv_dot_min_rows": 1,
                                         "qkv": {"SPLIT_K": 3, "BLOCK_K": 16},
                                         "down": {"SPLIT_K": 5, "BLOCK_K": 32}}},
    {"rows": 2, "layers": [3], "knobs": {"gemv_dot_min_rows": 4, "o": {"SPLIT_K": 3, "BLOCK_K": 16},
                                         "lm_head": {"BLOCK_N": 16, "BLOCK_K": 64}}},
    {"rows": 1, "layers": [1], "knobs": {"gemv_reduce_each_step": True, "qkv": {"SPLIT_K": 3, "BLOCK_K": 16}}},
    {"rows": 2, "layers": [1, 3], "knobs": {"attn": SPLITS | EXACT}},
    {"rows": 3, "layers": [2], "knobs": {"attn": SPLITS | ONLINE}},
    {"rows": 1, "layers": [0], "knobs": {"attn": {"NSPLIT": 1, "BLOCK_S": 16} | EXACT | NOFUSE}},
    {"rows": 3, "layers": [1, 3], "knobs": {"stages": {"attention": True, "norm": False, "gemv": False}}},
    {"rows": 3, "layers": [1, 3], "knobs": {"stages": {"attention": True, "norm": True, "gemv": False}}},
    # weights loaded before the wait (PRE: whole split, part of it, ragged last split), the
    # first K/V block too (this step's row from the cache or from the writing program's registers)
    {"rows": 1, "layers": [0, 2], "knobs": {"qkv": {"SPLIT_K": 2, "BLOCK_K": 16, "PRE": 4},
                                            "o": {"SPLIT_K": 3, "BLOCK_K": 16, "PRE": 2},
                                            "gate_up": {"BLOCK_K": 32, "PRE": 2, "REDUCE_EACH": True},
                                            "down": {"SPLIT_K": 5, "BLOCK_K": 32, "PRE": 2},
                                            "lm_head": {"BLOCK_K": 64, "PRE": 1},
                                            "attn": SPLITS | EXACT | NOFUSE | PRE_KV}},
    {"rows": 3, "layers": [1, 3], "knobs": {"qkv": {"PRE": 1}, "gate_up": {"PRE": 1},
                                            "down": {"SPLIT_K": 3, "BLOCK_K": 32, "PRE": 2},
                                            "attn": SPLITS | ONLINE | {"FUSE_ROPE": True} | PRE_KV}},
    {"rows": 2, "layers": [2], "knobs": {"attn": {"NSPLIT": 1, "BLOCK_S": 16} | EXACT | PRE_KV}},
    {"rows": 1, "layers": [0], "knobs": {"gemv_reduce_each_step": True, "qkv": {"SPLIT_K": 3, "BLOCK_K": 16, "PRE": 2},
                                         "attn": {"NSPLIT": 1, "BLOCK_S": 16, "FUSE_ROPE": True} | ONLINE | PRE_KV}},
    {"rows": 2, "layers": [1, 3], "knobs": {"attn": SPLITS | EXACT | {"FUSE_ROPE": True} | PRE_KV}},
    # the step's inputs loaded before the wait (RoPE fused, and in its own kernel)
    {"rows": 1, "layers": [0, 2], "knobs": {"attn": SPLITS | ONLINE | {"FUSE_ROPE": True} | EARLY}},
    {"rows": 3, "layers": [1, 3], "knobs": {"attn": SPLITS | EXACT | NOFUSE | EARLY}},
    # each K step's tiles loaded a step ahead: whole and ragged splits, after PRE (the loop
    # then one step or none), the FMA GEMV with and without REDUCE_EACH, and the tl.dot one
    {"rows": 1, "layers": [0, 2], "knobs": {"qkv": {"SPLIT_K": 3, "BLOCK_K": 16} | PIPE,
                                            "o": {"SPLIT_K": 2, "BLOCK_K": 32, "PRE": 1} | PIPE,
                                            "gate_up": {"BLOCK_K": 32, "REDUCE_EACH": True} | PIPE,
                                            "down": {"SPLIT_K": 5, "BLOCK_K": 32, "PRE": 2} | PIPE,
                                            "lm_head": {"BLOCK_K": 64, "REDUCE_EACH": False} | PIPE}},
    {"rows": 2, "layers": [1, 3], "knobs": {"qkv": {"SPLIT_K": 3, "BLOCK_K": 16} | PIPE, "o": PIPE,
                                            "gate_up": {"BLOCK_K": 32} | PIPE, "down": PIPE, "lm_head": PIPE,
                                            "l2": {"WEIGHTS_EVICT_FIRST": True, "KV_EVICT_LAST": True}}},
    # the norms folded into the GEMVs (batch 1): every layer; weights before the wait and split
    # GEMVs (qkv's split sums the row's squares apart; o and down add atomically, ragged splits);
    # each step reduced, online softmax and a GEMV a step ahead; batch 2 keeps the norm kernels
    {"rows": 1, "knobs": FOLD},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"qkv": {"SPLIT_K": 2, "BLOCK_K": 16, "PRE": 4},
                                                   "o": {"SPLIT_K": 3, "BLOCK_K": 16, "PRE": 2},
                                                   "gate_up": {"BLOCK_K": 32, "PRE": 2, "REDUCE_EACH": True},
                                                   "down": {"SPLIT_K": 5, "BLOCK_K": 32, "PRE": 2},
                                                   "lm_head": {"BLOCK_K": 64, "PRE": 1}}},
    {"rows": 1, "layers": [1], "knobs": FOLD | {"gemv_reduce_each_step": True, "qkv": {"SPLIT_K": 3, "BLOCK_K": 16},
                                                "lm_head": PIPE, "attn": SPLITS | ONLINE | {"FUSE_ROPE": True}}},
    {"rows": 2, "layers": [1, 3], "knobs": FOLD},
    # the MLP in one kernel (gate_up's rows, then down's columns added into the other residual
    # buffer): every layer (K ragged against BLOCK_K); whole K steps, PRE and the first down
    # tile before the wait; PIPE on 16-row tiles
    {"rows": 1, "knobs": FOLD | {"mlp": {"FUSED": True}}},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"mlp": {"FUSED": True, "DOWN_PRE": True},
                                                   "gate_up": {"BLOCK_K": 32, "PRE": 2, "REDUCE_EACH": True}}},
    {"rows": 1, "layers": [1], "knobs": FOLD | {"mlp": {"FUSED": True, "DOWN_PRE": True},
                                                "gate_up": {"BLOCK_K": 64, "BLOCK_N": 16} | PIPE}},
    # ... down read from prepare's transposed copy (DOWN_T), with and without DOWN_PRE
    {"rows": 1, "layers": [0, 3], "knobs": FOLD | {"mlp": {"FUSED": True, "DOWN_T": True}}},
    {"rows": 1, "layers": [2], "knobs": FOLD | {"mlp": {"FUSED": True, "DOWN_T": True, "DOWN_PRE": True},
                                                "gate_up": {"BLOCK_K": 32, "PRE": 1}}},
    # RoPE and the K/V write in qkv's kernel (ROPE), each beside its twin with RoPE in attention
    # or in its own kernel (TWINS: bitwise the same logits and caches): folded, with PRE and
    # PIPE, 16-row tiles, exact softmax without the fold; batch 2 runs the tl.dot GEMV without it
    {"rows": 1, "knobs": FOLD | {"qkv": {"SPLIT_K": 1, "BLOCK_N": 8, "ROPE": True},
                                 "attn": SPLITS | ONLINE | {"FUSE_ROPE": True}}},
    {"rows": 1, "knobs": FOLD | {"qkv": {"SPLIT_K": 1, "BLOCK_N": 8},
                                 "attn": SPLITS | ONLINE | {"FUSE_ROPE": True}}},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"qkv": {"SPLIT_K": 1, "BLOCK_N": 16, "BLOCK_K": 32, "PRE": 2,
                                                           "ROPE": True} | PIPE,
                                                   "attn": SPLITS | ONLINE | NOFUSE | EARLY}},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"qkv": {"SPLIT_K": 1, "BLOCK_N": 16, "BLOCK_K": 32, "PRE": 2}
                                                   | PIPE, "attn": SPLITS | ONLINE | NOFUSE | EARLY}},
    {"rows": 1, "layers": [1, 3], "knobs": {"qkv": {"SPLIT_K": 1, "BLOCK_N": 4, "ROPE": True}, "attn": SPLITS | EXACT}},
    {"rows": 1, "layers": [1, 3], "knobs": {"qkv": {"SPLIT_K": 1, "BLOCK_N": 4}, "attn": SPLITS | EXACT}},
    {"rows": 2, "layers": [1], "knobs": {"qkv": {"SPLIT_K": 1, "ROPE": True}}},
    # qkv's SMEM (a CUDA kernel): off the GPU the Triton GEMV runs, bitwise as with it off
    {"rows": 1, "layers": [1], "knobs": FOLD | {"qkv": {"SMEM": "tma", "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4}}},
    {"rows": 1, "layers": [1], "knobs": FOLD | {"qkv": {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4}}},
    # o_proj and gate_up in one kernel (a CUDA kernel): off the GPU their own kernels run, bitwise
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"o_gate_up": {"FUSED": True}}},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD},
    # the attention splits' sums divided in o_proj (IN_O): RoPE fused into attention, o_proj's
    # weights before the wait; RoPE in its own kernel, o_proj's K loop a step ahead on ragged
    # splits; with a key scored far above the step's own (boost: the sums' weights overflow, and
    # o_proj merges the splits' partials instead), beside the combine kernel on the same cache
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"attn": SPLITS | ONLINE | {"FUSE_ROPE": True}, "combine": IN_O,
                                                   "o": {"PRE": 4, "BLOCK_K": 16}}},
    {"rows": 1, "layers": [1], "knobs": FOLD | {"attn": SPLITS | ONLINE | NOFUSE | EARLY, "combine": IN_O,
                                                "o": {"PRE": 0, "BLOCK_K": 16, "SPLIT_K": 3} | PIPE}},
    {"rows": 1, "layers": [0, 3], "boost": 1000.0,
     "knobs": FOLD | {"attn": SPLITS | ONLINE | {"FUSE_ROPE": True}, "combine": IN_O}},
    {"rows": 1, "layers": [0, 3], "boost": 1000.0, "knobs": FOLD | {"attn": SPLITS | ONLINE | {"FUSE_ROPE": True}}},
    # the K loops software-pipelined by Triton (LOOP_STAGES): folded, after PRE, ragged splits,
    # a step ahead too, beside the same case without it; and on the tl.dot path
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"qkv": {"SPLIT_K": 3, "BLOCK_K": 16, "LOOP_STAGES": 3},
                                                   "o": {"SPLIT_K": 2, "BLOCK_K": 32, "PRE": 1, "LOOP_STAGES": 2},
                                                   "gate_up": {"BLOCK_K": 32, "REDUCE_EACH": True, "LOOP_STAGES": 4},
                                                   "down": {"SPLIT_K": 5, "BLOCK_K": 32, "PRE": 2, "LOOP_STAGES": 3}
                                                   | PIPE, "lm_head": {"BLOCK_K": 64, "LOOP_STAGES": 3}}},
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"qkv": {"SPLIT_K": 3, "BLOCK_K": 16},
                                                   "o": {"SPLIT_K": 2, "BLOCK_K": 32, "PRE": 1},
                                                   "gate_up": {"BLOCK_K": 32, "REDUCE_EACH": True},
                                                   "down": {"SPLIT_K": 5, "BLOCK_K": 32, "PRE": 2} | PIPE,
                                                   "lm_head": {"BLOCK_K": 64}}},
    {"rows": 2, "layers": [1, 3], "knobs": {"qkv": {"LOOP_STAGES": 3}, "down": {"SPLIT_K": 3, "LOOP_STAGES": 4}}},
    # the H200 example's GEMV tiles: down on 8-row tiles on 4 warps reduced at every K step,
    # gate_up's batch-1 programs on fewer rows than its batched (tl.dot) ones; batch 1 and 2
    {"rows": 1, "layers": [0, 2], "knobs": FOLD | {"down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4,
                                                            "REDUCE_EACH": True},
                                                   "gate_up": {"BLOCK_N": 16, "DOT_BLOCK_N": 32}}},
    {"rows": 2, "layers": [1, 3], "knobs": {"down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "REDUCE_EACH": True},
                                            "gate_up": {"BLOCK_N": 16, "DOT_BLOCK_N": 32}}},
]
# BF16_CASES indices (a knob on, the same case without it): bitwise the same logits and caches
TWINS = [(32, 33, ("qkv", "ROPE")), (34, 35, ("qkv", "ROPE")), (36, 37, ("qkv", "ROPE")), (39, 40, ("qkv", "SMEM")),
         (41, 42, ("o_gate_up", "FUSED")), (45, 46, ("combine", "IN_O")), (47, 48, ("down", "LOOP_STAGES"))]
FP32_CASES = [BF16_CASES[i] for i in (1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 14, 15, 16, 17, 19, 20, 21, 22, 24, 25, 26,
                                       27, 28, 30, 34, 35, 38, 43, 44, 45, 46)]
FP32_TWINS = [(24, 25, ("qkv", "ROPE")), (29, 30, ("combine", "IN_O"))]


SCRIPT_HELPERS = r'''
import os
if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton 3.x's interpreter turns a loaded scalar (a 1-element array) into a Python int
    # with int(array), which NumPy >= 2.3 refuses for arrays of one dimension; take the element.
    import numpy as np
    import triton.runtime.interpreter as _ti
    _orig_patch = _ti._patch_lang_tensor
    def _patch(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    _ti._patch_lang_tensor = _patch


def apply_knobs(knobs, override):
    """Put a case's KNOBS overrides in: dicts merged one level down, other values replaced."""
    for key, val in override.items():
        if isinstance(val, dict):
            knobs[key].update(val)
        else:
            knobs[key] = val
'''


def run_script(script: str, args: list[str], interpret: bool, **env_extra: str) -> list[dict]:
    """Run SCRIPT_HELPERS + `script` in a fresh Python (Triton reads TRITON_INTERPRET at
    import) with the project on its path; returns the JSON of its last `RESULTS ` line."""
    env = dict(os.environ, TKCC_LOG_LEVEL="WARNING", **env_extra,
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT_HELPERS + script, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def run_interpreter(path: Path, dtype: str, cases: list[dict]) -> list[dict]:
    return run_script(INTERPRETER_SCRIPT, [str(path), dtype, json.dumps(cases)], interpret=True)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_decode_under_the_interpreter(dtype):
    cases = FP32_CASES if dtype == "float32" else BF16_CASES
    results = run_interpreter(EXAMPLES / "llama_triton_decode.py", dtype, cases)
    print()
    for r in results:
        print(dtype, json.dumps(r["case"]), f"max|diff| {r['max_diff']:.3g} (max|ref| {r['max_ref']:.3g}) "
              f"bitwise {r['bitwise']} kv owned {r['kv_owned_diff']:.3g} ({r['seconds']:.1f} s)")
    for r in results:
        what = f"{dtype} {r['case']}"
        assert r["used_triton"], what
        assert r["shape"][0] == r["case"]["rows"] and r["dtype"] == f"torch.{dtype}", what
        assert r["argmax_equal"], what
        assert r["weights_untouched"], what
        mlp = r["case"].get("knobs", {}).get("mlp", {})  # prepare's copies: only with DOWN_T, one a layer
        assert r["prepared"] == sorted(f"down_t.{i}" for i in r["layers"] if mlp.get("FUSED") and mlp.get("DOWN_T")), what
        assert r["kv_outside_diff"] == 0.0, f"{what}: wrote K/V outside the batch's cells"
        scale = max(1.0, r["max_ref"])
        folded = r["case"]["rows"] == 1 and r["case"].get("knobs", {}).get("norm", {}).get("FOLD", False)
        if dtype == "float32":
            assert r["max_diff"] <= 1e-4 * scale, what
            assert r["kv_owned_diff"] <= 1e-4 * max(1.0, r["kv_owned_ref"]), what
        elif folded:
            # the residual in float32 and the norms unrounded: a few ulps of the logits, not 0
            assert 0 < r["max_diff"] <= 5e-2 * scale, what
            assert r["kv_owned_diff"] <= 5e-2 * max(1.0, r["kv_owned_ref"]), what
        elif r["exact_softmax"]:
            # rounded where the reference rounds: equal but for the odd last-bit flip
            assert r["allclose"], what
            assert r["kv_owned_diff"] <= 1e-2 * max(1.0, r["kv_owned_ref"]), what
        else:
            # online softmax rounds p before normalising: bf16 noise, a few ulps of the logits
            assert r["max_diff"] <= 5e-2 * scale, what
            assert r["kv_owned_diff"] <= 5e-2 * max(1.0, r["kv_owned_ref"]), what
    for i, j, (group, knob) in FP32_TWINS if dtype == "float32" else TWINS:
        assert results[i]["case"]["knobs"][group][knob] and knob not in results[j]["case"]["knobs"].get(group, {})
        assert results[i]["digest"] == results[j]["digest"], f"{dtype}: {group}'s {knob} changed it: {results[i]['case']}"


# ---- the PDL path, compiled for sm_90 without a GPU ------------------------------------

# a decode step's kernel launches recorded, not run (argv[1]: the example's path): `mod`,
# `state` (shrunk Llama, every layer, 3 cache rows), `launches` [(kernel, grid, args, kwargs)]
LAUNCHES_SETUP = r'''
import json, sys
import torch
from triton.runtime.jit import JITFunction
from engine_server.candidate import load_module
from engine_server.config import resolve_model, shrink
from engine_server.models import llama as ref
from engine_server.state import State, decode_batch, new_cache
from engine_server.weights import init_weights

mod = load_module("launches", open(sys.argv[1]).read())
mod._supported = lambda state, batch: True
# KNOBS["qkv"]["SMEM"]: an H100's shared memory a program
mod._smem_capable = lambda dev: 232448 if getattr(mod, "HAVE_GLUON", False) else 0
mod._pdl_capable = lambda dev: True
mod._sms = lambda dev: (132, 233472)  # an H100's SMs and shared memory an SM (KNOBS["o_gate_up"])
launches = []
JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kw: launches.append((self, grid, args, kw)))
cfg = shrink(resolve_model("llama-3.2-1b")[0])
weights = init_weights(cfg, 0, torch.bfloat16, "cpu")
tables = ref.tables(cfg, weights, 64, torch.bfloat16, "cpu")
k, v = new_cache(cfg, 3, 64, torch.bfloat16, "cpu")
state = State(cfg, weights, k, v, tables, tuple(range(cfg.num_layers)))
'''

AOT_SCRIPT = LAUNCHES_SETUP + r'''
import re
from benchmarks.kernel_resources import compile_sm90, specialise
CONFIGS = [{}, {"qkv": {"PF_STEPS": 2}, "pdl": {"PREFETCH_O": True}, "attn": {"FUSE_ROPE": True},
                "l2": {"GATE_UP_STEPS": 1, "BY": "o", "AT": "entry"}},
           {"attn": {"FUSE_ROPE": True, "EXACT_SOFTMAX": False}},
           {"qkv": {"PRE": 1}, "down": {"PRE": 1}, "attn": {"PRELOAD_KV": True, "FUSE_ROPE": True},
            "pdl": {"EARLY_TRIGGER": True}},
           {"attn": {"FUSE_ROPE": True, "EXACT_SOFTMAX": False, "PRELOAD_KV": False, "EARLY_INPUTS": True},
            "qkv": {"PIPE": True}, "o": {"PIPE": True, "PRE": 1}, "gate_up": {"PIPE": True, "PRE": 1, "BLOCK_K": 32, "maxnreg": 128},
            "down": {"PIPE": True}, "lm_head": {"PIPE": True}, "norm": {"EARLY_TRIGGER": True},
            "combine": {"EARLY_TRIGGER": True},
            "l2": {"WEIGHTS_EVICT_FIRST": True, "KV_EVICT_LAST": True, "GATE_UP_STEPS": 8, "BY": "qkv",
                   "END_DOWN": True, "END_QKV": True}},
           {"norm": {"FOLD": True, "EARLY_TRIGGER": True}, "attn": {"FUSE_ROPE": True, "EXACT_SOFTMAX": False},
            "qkv": {"PRE": 1}, "o": {"PRE": 2, "EARLY_TRIGGER": True}, "gate_up": {"PRE": 1, "BLOCK_K": 32},
            "down": {"EARLY_TRIGGER": True}, "l2": {"GATE_UP_STEPS": 2, "BY": "attn", "AT": "entry"}},
           {"norm": {"FOLD": True}, "mlp": {"FUSED": True, "DOWN_PRE": True}},
           {"norm": {"FOLD": True}, "mlp": {"FUSED": True, "DOWN_T": True}},
           {"norm": {"FOLD": True}, "qkv": {"SPLIT_K": 1, "BLOCK_N": 8, "PRE": 4, "PIPE": True, "ROPE": True},
            "attn": {"EXACT_SOFTMAX": False, "EARLY_INPUTS": True}},
           {"norm": {"FOLD": True}, "qkv": {"SMEM": "async", "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4}},
           {"norm": {"FOLD": True}, "qkv": {"SMEM": "tma", "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4}},
           {"norm": {"FOLD": True}, "o_gate_up": {"FUSED": True}},
           {"norm": {"FOLD": True}, "o_gate_up": {"FUSED": True, "STAGE_K": 64, "STAGES": 1, "EARLY": 0}},
           {"norm": {"FOLD": True}, "attn": {"FUSE_ROPE": True, "EXACT_SOFTMAX": False}, "combine": {"IN_O": True},
            "o": {"PRE": 4}}]
knobs0 = json.loads(json.dumps(mod.KNOBS))
for conf in CONFIGS:
    mod.KNOBS.clear()
    mod.KNOBS.update(json.loads(json.dumps(knobs0)))
    mod.KNOBS["pdl"]["enabled"] = True
    apply_knobs(mod.KNOBS, conf)
    mod.prepare(state)
    for rows in (1, 2):  # the FMA GEMV and the tl.dot one
        mod.forward(state, decode_batch(torch.tensor([7, 11][:rows]), torch.tensor([5, 9][:rows]),
                                        torch.tensor([0, 1][:rows])))
seen, out = set(), []
for fn, grid, args, kw in launches:
    sig, consts, attrs = specialise(fn, args, kw)
    key = (fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items())), repr(sorted(attrs)), kw.get("maxnreg"))
    if key in seen:
        continue
    seen.add(key)
    c = compile_sm90(fn, args, kw)
    ptx = c.asm["ptx"]
    assert c.asm.get("cubin"), "no sm_90 machine code"
    out.append(dict(kernel=fn.__name__, launch_pdl=bool(c.metadata.launch_pdl), wait="griddepcontrol.wait" in ptx,
                    trigger="griddepcontrol.launch_dependents" in ptx, prefetch="prefetch.global.L2" in ptx,
                    prefetch_wanted=bool(consts.get("PF_STEPS") or consts.get("PF_CHUNK")),
                    bulk="cp.async.bulk.prefetch.L2.global" in ptx, l2_at=consts.get("L2_AT", 0),
                    maxnreg=".maxnreg 128" in ptx, maxnreg_wanted=kw.get("maxnreg") == 128,
                    bulk_before_wait=ptx.find("cp.async.bulk.prefetch") < ptx.find("griddepcontrol.wait"),
                    fused_rope=bool(consts.get("FUSE_ROPE")), pdl=consts["PDL"],
                    preload=bool(consts.get("PRE_K") or consts.get("PRELOAD_KV") or consts.get("EARLY_INPUTS")),
                    early=bool(consts.get("EARLY_INPUTS")), evict_wanted=bool(consts.get("EVW") or consts.get("KV_EV")),
                    evict="evict_first" in ptx or "evict_last" in ptx,
                    load_before_wait=ptx.find("ld.global") < ptx.find("griddepcontrol.wait"),
                    norm=bool(consts.get("NORM", True)), fold=bool(consts.get("FOLD")),
                    down=bool(consts.get("DOWN")), zero=bool(consts.get("Z_BLOCK")), rope=bool(consts.get("ROPE")),
                    sums=bool(consts.get("SUM")), xh=consts.get("XH", 0),
                    stores=ptx.count("st.global"), cp_async=ptx.count("cp.async.cg.shared.global"),
                    tma=ptx.count("cp.async.bulk.tensor"),
                    tma_before_wait=-1 < ptx.find("cp.async.bulk.tensor") < ptx.find("griddepcontrol.wait"),
                    cp_async_before_wait=-1 < ptx.find("cp.async.cg.shared.global") < ptx.find("griddepcontrol.wait"),
                    atomic_wanted=bool(consts.get("ATOMIC") or consts.get("DOWN") or consts.get("SUM") or "NPROG" in consts), atomic=re.search(r"(?<![.\w])(?:red|atom)\.global", ptx) is not None,
                    trigger_before_wait=ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait"),
                    consts={k: v for k, v in consts.items() if isinstance(v, (int, bool))},
                    acquire=ptx.count("ld.acquire.gpu"), release=len(re.findall(r"(?:red|atom)\.global\.gpu\.release", ptx)),
                    tma_after_wait=ptx[ptx.find("griddepcontrol.wait"):].count("cp.async.bulk.tensor")))
print("RESULTS " + json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_pdl_kernels_compile_for_sm90():
    """With KNOBS["pdl"] on, every launch of a decode step (batch 1 and 2; RoPE in its own
    kernel or fused into attention, exact or online softmax) compiles for sm_90 with the PDL launch flag, waits on the kernel before it
    and lets the next one launch (after the wait, or before it with EARLY_TRIGGER); GEMVs with
    PF_STEPS and the first attention kernel with PREFETCH_O carry their L2 prefetches; GEMVs
    with PRE and attention with PRELOAD_KV or EARLY_INPUTS issue loads before the wait."""
    res = run_script(AOT_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py")], interpret=False,
                     TRITON_DEFAULT_FP_FUSION="1")
    kernels = {r["kernel"] for r in res}
    assert kernels == {"_add_norm_kernel", "_gemv_kernel", "_rope_kv_kernel", "_attn_kernel",
                       "_attn_combine_kernel", "_gemv_smem_kernel", "_o_gate_up_kernel"}, kernels
    for r in res:
        assert r["launch_pdl"] and r["wait"] and r["trigger"], r
        assert r["prefetch"] == r["prefetch_wanted"], r
        assert r["trigger_before_wait"] == (r["pdl"] == 2), r
        if r["preload"] or (r["kernel"] == "_add_norm_kernel" and r["norm"]):  # the norm weight: always before
            assert r["load_before_wait"], r
        assert r["atomic"] == r["atomic_wanted"], r  # o and down add into the residual (FOLD), and only they
        assert r["maxnreg"] == r["maxnreg_wanted"], r  # a group's register cap, where it asks for one
        assert r["bulk"] == (r["l2_at"] > 0), r  # KNOBS["l2"]["GATE_UP_STEPS"]: before or after the wait
        if r["bulk"]:
            assert r["bulk_before_wait"] == (r["l2_at"] == 1), r  # 3: at the end
    assert {r["pdl"] for r in res} == {1, 2}
    for kernel in ("_add_norm_kernel", "_attn_combine_kernel"):  # their own EARLY_TRIGGER
        assert {r["pdl"] for r in res if r["kernel"] == kernel} == {1, 2}, kernel
    assert {r["kernel"] for r in res if r["preload"]} == {"_gemv_kernel", "_attn_kernel"}
    assert any(r["prefetch"] and r["kernel"] == "_attn_kernel" for r in res)
    assert any(r["prefetch"] and r["kernel"] == "_gemv_kernel" for r in res)
    assert any(r["fused_rope"] for r in res)
    assert any(r["early"] and r["load_before_wait"] for r in res)
    for r in res:  # L2 eviction priorities where KNOBS["l2"] asks for them, and only there
        assert r["evict"] == r["evict_wanted"], r
    assert {r["kernel"] for r in res if r["evict"]} == {"_gemv_kernel", "_attn_kernel"}
    # FOLD: the step's one norm-group kernel only gathers; qkv, gate_up and lm_head fold their
    # norm in (qkv's split summing its row's squares apart), o and down add atomically; with the
    # MLP fused (the last two configs) qkv also zeroes a buffer and one kernel folds and adds,
    # loading its first down tile before the wait with DOWN_PRE (lm_head and the gather as
    # before, o another one); the ROPE config adds a qkv, a gate_up and a down; o_gate_up's
    # config a qkv (and its kernel, below)
    assert any(not r["norm"] for r in res) and sum(r["fold"] and not (r["down"] or r["zero"]) for r in res) == 6
    # the fold configs' o and down launches, the two fused MLPs, IN_O's attention and o_proj
    # (and o_gate_up's barrier, below)
    assert sum(r["atomic"] for r in res if r["kernel"] != "_o_gate_up_kernel") == 8
    fused = [r for r in res if r["down"]]  # down in its own layout (its first tile before the wait) and transposed
    assert len(fused) == 2 and all(r["fold"] and r["atomic"] for r in fused), fused
    assert sorted(r["load_before_wait"] for r in fused) == [False, True], fused
    assert [r["fold"] for r in res if r["zero"]] == [True, True]  # the fused MLP's residual, IN_O's sums
    # IN_O (the last config): the attention kernel adds into the heads' sums, o_proj's GEMV
    # divides them as it loads (its weights loaded before the wait) and adds into the residual
    sums = [r for r in res if r["sums"]]
    assert len(sums) == 1 and sums[0]["kernel"] == "_attn_kernel" and sums[0]["atomic"], sums
    div = [r for r in res if r["xh"]]
    assert len(div) == 1 and div[0]["atomic"] and div[0]["load_before_wait"] and div[0]["consts"]["PRE_K"], div
    # qkv's SMEM (the last two configs, batch 1): the Gluon kernel copies its 32 rows of qkv's
    # weight (the shrunk preset's 128 bf16 columns each) into shared memory before its wait:
    # "async" 16 bytes a thread a copy on 4 warps, "tma" one bulk tensor copy a 64-column box
    smem = [r for r in res if r["kernel"] == "_gemv_smem_kernel"]
    assert len(smem) == 2, smem
    assert smem[0]["cp_async"] == 32 * 128 * 2 // (16 * 128) and smem[0]["cp_async_before_wait"] and not smem[0]["tma"]
    assert smem[1]["tma"] == 128 // 64 and smem[1]["tma_before_wait"] and not smem[1]["cp_async"], smem
    # o_gate_up (the last two configs): bulk tensor copies of o's rows (the shrunk preset's 256
    # columns: 4 boxes of 64) before the wait, and of gate_up's 128 columns: in one stage of 2
    # boxes of gate and 2 of up, also before it (EARLY); or in 2 stages of one box each on a
    # ring of one, filled after the wait (EARLY 0) and refilled in the loop. One release add
    # and acquire polls: its grid barrier
    ogu = {r["consts"]["EARLY"]: r for r in res if r["kernel"] == "_o_gate_up_kernel"}
    assert sorted(ogu) == [0, 1], ogu
    assert ogu[1]["tma"] == 8 and ogu[1]["tma_after_wait"] == 0 and ogu[1]["tma_before_wait"], ogu[1]
    assert ogu[0]["tma"] == 8 and ogu[0]["tma_after_wait"] == 4 and ogu[0]["tma_before_wait"], ogu[0]
    assert all(r["release"] == 1 and r["acquire"] >= 1 and r["pdl"] == 2 and r["consts"]["NPROG"] == 6
               for r in ogu.values()), ogu
    # qkv's ROPE: the one qkv launch stores q, k and v (three stores, no partials, no atomics),
    # its step inputs and weights loaded before the wait
    rope = [r for r in res if r["rope"]]
    assert len(rope) == 1 and rope[0]["fold"] and rope[0]["stores"] == 3 and not rope[0]["atomic"], rope
    assert rope[0]["load_before_wait"], rope
    assert any(r["maxnreg"] for r in res)
    bulk = {(r["kernel"], r["l2_at"]) for r in res if r["bulk"]}
    assert bulk == {("_attn_kernel", 1), ("_gemv_kernel", 1), ("_gemv_kernel", 2), ("_gemv_kernel", 3)}, bulk


LAUNCH_PDL_SCRIPT = LAUNCHES_SETUP + r'''
apply_knobs(mod.KNOBS, json.loads(sys.argv[2]))
mod.forward(state, decode_batch(torch.tensor([7]), torch.tensor([5]), torch.tensor([0])))
out = []
for fn, grid, args, kw in launches:
    w = args[1] if fn.__name__ == "_gemv_kernel" else None
    what = fn.__name__ if w is None else ("o" if tuple(w.shape) == (cfg.hidden_size, cfg.num_heads * cfg.head_dim) else "gemv")
    out.append({"what": what, "pdl": kw["PDL"]})
print("RESULTS " + json.dumps(out))
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_early_trigger_per_gemv_group_and_attention():
    """KNOBS[group]["EARLY_TRIGGER"] for a GEMV group ("o" here) and for "attn" launches just
    those kernels with PDL mode 2 (trigger at entry); every other kernel keeps mode 1."""
    knobs = {"o": {"EARLY_TRIGGER": True}, "attn": {"EARLY_TRIGGER": True},
             "pdl": {"enabled": True, "EARLY_TRIGGER": False}}
    res = run_script(LAUNCH_PDL_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py"), json.dumps(knobs)], interpret=False)
    modes: dict = {}
    for r in res:
        modes.setdefault(r["what"], set()).add(r["pdl"])
    assert modes["o"] == {2} and modes["_attn_kernel"] == {2}, modes
    assert modes["gemv"] == {1} and modes["_add_norm_kernel"] == {1}, modes


TILE_LAUNCH_SCRIPT = LAUNCHES_SETUP + r'''
apply_knobs(mod.KNOBS, json.loads(sys.argv[2]))
gate_up = (2 * cfg.intermediate_size, cfg.hidden_size)
out = {}
for rows in (1, 3):
    launches.clear()
    mod.forward(state, decode_batch(torch.tensor([7, 8, 9][:rows]), torch.tensor([5, 6, 7][:rows]),
                                    torch.tensor([0, 1, 2][:rows])))
    out[rows] = sorted({kw["BLOCK_N"] for fn, grid, args, kw in launches
                        if fn.__name__ == "_gemv_kernel" and tuple(args[1].shape) == gate_up})
print("RESULTS " + json.dumps(out))
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_dot_block_n_tiles_only_the_batched_gemv():
    """KNOBS[group]["DOT_BLOCK_N"] sets the weight rows a program on the tl.dot path (batched
    rows) and leaves batch 1 on BLOCK_N; without it the batched path takes BLOCK_N (at least 16)."""
    ex = str(EXAMPLES / "llama_triton_decode.py")
    got = run_script(TILE_LAUNCH_SCRIPT, [ex, json.dumps({"gate_up": {"BLOCK_N": 8, "DOT_BLOCK_N": 32}})],
                     interpret=False)
    assert got == {"1": [8], "3": [32]}, got
    got = run_script(TILE_LAUNCH_SCRIPT, [ex, json.dumps({"gate_up": {"BLOCK_N": 8}})], interpret=False)
    assert got == {"1": [8], "3": [16]}, got


L2_LAUNCHES_SCRIPT = LAUNCHES_SETUP + r'''
apply_knobs(mod.KNOBS, json.loads(sys.argv[2]))
try:
    mod.forward(state, decode_batch(torch.tensor([7]), torch.tensor([5]), torch.tensor([0])))
except ValueError as e:
    print("RESULTS " + json.dumps({"error": str(e)}))
    sys.exit(0)
tab = lambda name: [{**state.weights, **state.tables}[f"model.layers.{i}.{name}"].data_ptr()  # noqa: E731
                    for i in range(cfg.num_layers)]
D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
names = {((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, D): "qkv", (D, cfg.num_heads * hd): "o", (2 * I, D): "gate_up",
         (D, I): "down"}
out = []
for fn, grid, args, kw in launches:
    if kw.get("L2_AT"):
        what = names.get(tuple(args[1].shape), "lm_head") if fn.__name__ == "_gemv_kernel" else fn.__name__
        out.append({"what": what, "at": kw["L2_AT"], "ptr": kw["l2_ptr"].data_ptr(), "rows": kw["l2_rows"],
                    "stride": kw["l2_stride"], "bytes": kw["l2_bytes"], "ch": kw["L2_CH"], "warps": kw["num_warps"]})
print("RESULTS " + json.dumps({"out": out, "gate_up": tab("mlp.gate_up_proj.weight"), "I": I, "D": D,
                               "down": tab("mlp.down_proj.weight"), "qkv": tab("self_attn.qkv_proj.weight"),
                               "qkv_rows": (cfg.num_heads + 2 * cfg.num_kv_heads) * hd}))
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("by,at,steps,pre,bk", [("qkv", "wait", 2, 1, 32), ("attn", "entry", 100, 0, 256),
                                                ("o", "wait", 1, 2, 32)])
def test_gate_up_l2_prefetch_goes_to_the_layer_gate_up_weight(by, at, steps, pre, bk):
    """KNOBS["l2"]["GATE_UP_STEPS"] with PDL: in each layer exactly the kernel BY names (the first
    attention kernel for "attn") asks, AT its entry (1) or after its wait (2), for the K steps
    of every row of that layer's gate_up weight that follow gate_up's PRE (at most to the end
    of the row), one row a thread; without PDL, none."""
    ex = str(EXAMPLES / "llama_triton_decode.py")
    knobs = {"l2": {"GATE_UP_STEPS": steps, "BY": by, "AT": at}, "norm": {"FOLD": True},
             "gate_up": {"PRE": pre, "BLOCK_K": bk}}
    res = run_script(L2_LAUNCHES_SCRIPT, [ex, json.dumps(knobs)], interpret=False)
    what = "_attn_kernel" if by == "attn" else by
    D, skip = res["D"], pre * bk
    want = [{"what": what, "at": {"entry": 1, "wait": 2}[at], "ptr": p + 2 * skip, "rows": 2 * res["I"],
             "stride": 2 * D, "bytes": 2 * (min(D, skip + steps * bk) - skip)} for p in res["gate_up"]]
    assert [{k: r[k] for k in want[0]} for r in res["out"]] == want and want[0]["bytes"] > 0
    assert all(r["ch"] == 32 * r["warps"] for r in res["out"])
    knobs["pdl"] = {"enabled": False}
    assert run_script(L2_LAUNCHES_SCRIPT, [ex, json.dumps(knobs)], interpret=False)["out"] == []
    if by == "o":  # a kernel name it does not know: a clear error, not a silent no-op
        knobs["pdl"], knobs["l2"]["BY"] = {"enabled": True}, "gate_up"
        err = run_script(L2_LAUNCHES_SCRIPT, [ex, json.dumps(knobs)], interpret=False)["error"]
        assert "BY 'gate_up'" in err


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_weights_pulled_into_l2_as_the_gemv_before_them_ends():
    """KNOBS["l2"]["END_DOWN"] and ["END_QKV"] with PDL: each layer's gate_up launch asks, at its
    programs' end (L2_AT 3), for all of that layer's down weight, row by row, and each down
    launch but the last layer's for the next layer's qkv weight; nothing else asks, and nothing
    without PDL."""
    knobs = {"l2": {"END_DOWN": True, "END_QKV": True}, "norm": {"FOLD": True}}
    res = run_script(L2_LAUNCHES_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py"), json.dumps(knobs)],
                     interpret=False)
    D, I = res["D"], res["I"]
    got = [(r["what"], r["at"], r["ptr"], r["rows"], r["stride"], r["bytes"]) for r in res["out"]]
    want = []
    for i in range(len(res["down"])):
        want.append(("gate_up", 3, res["down"][i], D, 2 * I, 2 * I))  # the layer's down [D, I]
        if i + 1 < len(res["down"]):  # the next layer's qkv [(H + 2KV) hd, D]
            want.append(("down", 3, res["qkv"][i + 1], res["qkv_rows"], 2 * D, 2 * D))
    assert got == want
    knobs["pdl"] = {"enabled": False}
    assert run_script(L2_LAUNCHES_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py"), json.dumps(knobs)],
                      interpret=False)["out"] == []


FOLD_LAUNCHES_SCRIPT = LAUNCHES_SETUP + r'''
apply_knobs(mod.KNOBS, {"norm": {"FOLD": True}} | json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
out = []
for rows in (1, 2):
    launches.clear()
    mod.forward(state, decode_batch(torch.tensor([7, 11][:rows]), torch.tensor([5, 9][:rows]),
                                    torch.tensor([0, 1][:rows])))
    kinds = []
    for fn, grid, args, kw in launches:
        if fn.__name__ == "_add_norm_kernel":
            kinds.append("norm" if kw.get("NORM", True) else "gather")
        elif fn.__name__ == "_gemv_kernel":
            kinds.append("gemv_mlp" if kw["DOWN"] else "gemv_fold" if kw["FOLD"] else "gemv_atomic" if kw["ATOMIC"]
                         else "gemv")
        else:
            kinds.append(fn.__name__)
    # the residual buffers each GEMV reads (x), adds into (out) and zeroes (z)
    bufs = [{"x": a[0].data_ptr(), "out": a[2].data_ptr(), "z": kw["z_ptr"].data_ptr() if kw["Z_BLOCK"] else None,
             "z_block": kw["Z_BLOCK"], "down": a[1].shape[0] == 2 * cfg.intermediate_size and kw["DOWN"]
             and kw["wd_ptr"].data_ptr() in {state.weights[f"model.layers.{i}.mlp.down_proj.weight"].data_ptr()
                                             for i in range(cfg.num_layers)}}
            for fn, grid, a, kw in launches if fn.__name__ == "_gemv_kernel"]
    out.append({"rows": rows, "kinds": kinds, "gemvs": bufs})
print("RESULTS " + json.dumps(out))
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_folded_norms_launch_no_norm_kernels():
    """KNOBS["norm"]["FOLD"]: a batch-1 step launches one gather kernel and no norm kernel; per
    layer qkv and gate_up fold their norm in, o and down add into the residual atomically, and
    lm_head folds the final norm. A batch of 2 keeps the norm kernels (FMA GEMVs only fold)."""
    one, two = run_script(FOLD_LAUNCHES_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py")], interpret=False)
    # the shipped attention: RoPE in its own kernel, exact softmax in two passes
    layer = ["gemv_fold", "_rope_kv_kernel", "_attn_kernel", "_attn_kernel", "_attn_combine_kernel", "gemv_atomic",
             "gemv_fold", "gemv_atomic"]
    n = len([k for k in one["kinds"] if k == "_rope_kv_kernel"])
    assert one["kinds"] == ["gather"] + layer * n + ["gemv_fold"], one["kinds"]
    assert "norm" not in one["kinds"] and n == 4
    assert two["kinds"].count("norm") == 2 * n + 1 and "gather" not in two["kinds"], two["kinds"]
    assert not {"gemv_fold", "gemv_atomic"} & set(two["kinds"])
    assert not any(g["z"] or g["down"] for g in one["gemvs"] + two["gemvs"])


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_fused_mlp_alternates_the_residual_buffers():
    """KNOBS["mlp"]["FUSED"] with FOLD: per layer qkv, the attention, o, then one MLP kernel (no
    down launch). The MLP reads the layer's residual and adds into the other buffer, which that
    layer's qkv zeroed first; the two alternate, and lm_head reads the last MLP's output. A
    batch of 2 runs as without it."""
    one, two = run_script(FOLD_LAUNCHES_SCRIPT, [str(EXAMPLES / "llama_triton_decode.py"),
                                                 json.dumps({"mlp": {"FUSED": True}})], interpret=False)
    layer = ["gemv_fold", "_rope_kv_kernel", "_attn_kernel", "_attn_kernel", "_attn_combine_kernel", "gemv_atomic",
             "gemv_mlp"]
    assert one["kinds"] == ["gather"] + layer * 4 + ["gemv_fold"], one["kinds"]
    g = one["gemvs"]
    qkv, o, mlp, lm = g[0:-1:3], g[1:-1:3], g[2:-1:3], g[-1]
    assert all(m["down"] for m in mlp) and not any(x["down"] for x in qkv + o + [lm])
    assert all(q["z_block"] >= 128 for q in qkv) and not any(x["z"] for x in o + mlp + [lm])
    cur = qkv[0]["x"]
    for q, a, m in zip(qkv, o, mlp):
        assert q["x"] == a["out"] == m["x"] == cur  # the layer's residual: read, o adds into it
        assert q["z"] == m["out"] != cur  # the other buffer: zeroed by qkv, the MLP's sum
        cur = m["out"]
    assert len({m["out"] for m in mlp}) == 2 and lm["x"] == cur
    assert two["kinds"].count("norm") == 9 and "gemv_mlp" not in two["kinds"], two["kinds"]


# ---- one GEMV alone by tiling (benchmarks/stream_bench.py) -------------------------------

STREAM_SCRIPT = r'''
import json, sys
import torch
import benchmarks.stream_bench as sb
from engine_server.candidate import load_module
sb.DEVICE = "cpu"
sb.SHAPES.update(qkv=(96, 64), o=(64, 64), gate_up=(256, 64), down=(64, 128), lm_head=(200, 64))
mod = load_module("stream", open(sys.argv[1]).read())
gen = torch.Generator().manual_seed(0)
out = {}
for name in sb.SHAPES:
    shape = sb.Shape(name, gen, copies=1)
    own = shape.error(mod)
    knobs = dict(mod.KNOBS[name])
    mod.KNOBS[name].update({"BLOCK_N": 32, "BLOCK_K": 1024, "num_warps": 8, "REDUCE_EACH": True, "PIPE": True,
                            **({"SPLIT_K": sb.SPLITS[name][-1]} if name in sb.SPLITS else {})})
    other = shape.error(mod)
    mod.KNOBS[name].clear()
    mod.KNOBS[name].update(knobs)
    shape.want = shape.want.roll(1)  # another row's answer in each place: must read as wrong
    out[name] = [own, other, shape.error(mod)]
print("RESULTS " + json.dumps(out))
'''


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_stream_bench_checks_each_projection_as_the_step_calls_it():
    """benchmarks/stream_bench.py's answers, under the interpreter: the H200 file's GEMV on every
    projection, called as the decode step calls it, at the file's tiling and at another (wider
    tiles, reduced every K step, a step ahead, split), within the bench's tolerance of the
    float32 answer; a wrong answer reads beyond it."""
    from benchmarks.stream_bench import TOLERANCE
    got = run_script(STREAM_SCRIPT, [str(EXAMPLES / "llama_triton_decode_h200.py")], interpret=True)
    assert set(got) == {"qkv", "o", "gate_up", "down", "lm_head"}, got
    for name, (own, other, wrong) in got.items():
        assert own <= TOLERANCE and other <= TOLERANCE and wrong > TOLERANCE, (name, got[name])


# ---- the attention kernels alone (benchmarks/attn_check.py) ----------------------------

ATTN_CHECK_SCRIPT = r'''
import json, sys
from benchmarks.attn_check import check
import torch
settings = {"exact-split": {"EXACT_SOFTMAX": True, "NSPLIT": 4, "BLOCK_S": 16},
            "online-fuse": {"EXACT_SOFTMAX": False, "NSPLIT": 4, "BLOCK_S": 16, "FUSE_ROPE": True},
            "broken-scale": {"EXACT_SOFTMAX": True, "NSPLIT": 1}}
import benchmarks.attn_check as ac
orig = ac.run_case
def run_case(mod, state, knobs, positions, slots, seed):
    if knobs.get("NSPLIT") == 1:  # a deliberately wrong kernel: the check must see it
        real = mod._attn_kernel
        class Wrong:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    a = list(a); a[9] = a[9] * 2.0  # the softmax scale, doubled
                    return real[grid](*a, **kw)
                return launch
        mod._attn_kernel = Wrong()
        try:
            return orig(mod, state, knobs, positions, slots, seed)
        finally:
            mod._attn_kernel = real
    return orig(mod, state, knobs, positions, slots, seed)
ac.run_case = run_case
res = check("llama-3.2-1b", True, "cpu", torch.bfloat16, settings, [0, 17, 40], max_seq=64)
print("RESULTS " + json.dumps(res["settings"]))
'''


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_attn_check_tells_rounding_from_a_bug():
    """benchmarks/attn_check.py under the interpreter: the example's attention settings agree
    with the reference attention to rounding, K/V cells included, and a kernel fed a doubled
    softmax scale is far off."""
    rows = {r["setting"]: r for r in run_script(ATTN_CHECK_SCRIPT, [], interpret=True)}
    for name in ("exact-split", "online-fuse"):
        assert rows[name]["finite"] and rows[name]["worst_rel_err"] < 2e-2, rows[name]
        assert rows[name]["kv_max_diff"] == 0.0, rows[name]  # RoPE rounded where the reference rounds
        assert len(rows[name]["cases"]) == 6  # 3 positions, batch 1 and batch 2
    assert rows["broken-scale"]["worst_rel_err"] > 0.1, rows["broken-scale"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_attn_check_runs_on_the_cpu_as_a_user_runs_it():
    """`python benchmarks/attn_check.py --device cpu` with no TRITON_INTERPRET in the
    environment: the script asks for the interpreter itself (a CPU has no Triton driver)."""
    env = dict(os.environ, TKCC_LOG_LEVEL="WARNING")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attn_check.py"), "--device", "cpu",
                           "--shrink", "--positions", "0,17", "--max-seq", "64",
                           "--settings", '{"online": {"EXACT_SOFTMAX": false, "NSPLIT": 4, "BLOCK_S": 16}}'],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["settings"]
    assert row["finite"] and row["worst_rel_err"] < 2e-2 and len(row["cases"]) == 4, row


def test_example_source_merges_knobs_and_names_only_known_ones():
    """conftest.example_source (the GPU tests' way to vary an example): the file's KNOBS with
    the override merged in key by key, the rest of the file as it is; a knob the file does not
    have (a typo, a renamed knob) is an error unless its code reads it (an optional knob)."""
    from conftest import example_source

    from benchmarks.forward_bench import find_knobs
    name = "llama_triton_decode_h200"
    base, span = find_knobs(example_source(name))
    src = example_source(name, {"gate_up": {"BLOCK_K": 32, "maxnreg": 128}, "norm": {"FOLD": False}})
    knobs, new_span = find_knobs(src)
    assert knobs == {**base, "gate_up": {**base["gate_up"], "BLOCK_K": 32, "maxnreg": 128},
                     "norm": {**base["norm"], "FOLD": False}}
    assert src.encode()[new_span[1]:] == example_source(name).encode()[span[1]:]  # the code after KNOBS as it was
    with pytest.raises(ValueError, match="GATE_UP_STEP"):
        example_source(name, {"l2": {"GATE_UP_STEP": 2}})
