"""Ladder step 1 of 3: only RoPE, the K/V write and attention run in Triton (decode);
the embedding, norms, residual adds and projections are the reference's PyTorch ops.
Gate: on CUDA the tolerance gate (`close`, identical tokens; the RoPE'd K/V differ from
the reference's by rounding, so not bitwise); on the CPU (reference fallback) bitwise.

Llama decode in Triton: fused RMSNorm, bandwidth GEMVs, RoPE + K/V write, flash-decode.

What it changes: for decode steps (batch.seq_len == 1) on CUDA (or on CPU tensors under the
Triton interpreter, TRITON_INTERPRET=1) the whole forward pass runs as Triton kernels, 10
launches per layer (8 with online softmax and FUSE_ROPE, 6 with the norms folded into the
GEMVs too) instead of ~28. Prefill (T > 1), devices without Triton and model
features these kernels do not cover (q/k/v bias, qk-norm, MoE, non-SiLU MLP) run the
reference (`engine_server.models.llama.forward`) unchanged.

Gate: `check_bit_exact(mode="tolerance")` -> `close` with identical greedy tokens. On CUDA
it is not bitwise against cuBLAS (another summation order), but it accumulates in float32
everywhere and rounds to the model dtype exactly where the reference rounds (projection
outputs, RoPE products and sum, attention scores, softmax probabilities after normalising
with KNOBS["attn"]["EXACT_SOFTMAX"], residual adds, norms, SiLU and its product), so what
remains is the odd last-bit flip of a different accumulation order. With KNOBS["norm"]["FOLD"]
the residual stays in float32 and the norms' outputs are not rounded (and the atomic adds into
the residual land in any order): still within the tolerance gate, further from bitwise. Under the Triton
interpreter on the CPU (shrunk Llama, bfloat16) its logits and K/V cache are bitwise equal
to the CPU reference's. On the CPU without the interpreter the reference runs: bitwise.

Per layer, decode (B rows, D hidden, H q heads, KV kv heads, hd head dim, I intermediate):

    add_norm      x += sum(partials); h = rms_norm(x)       (first layer: x = embed[tokens])
    gemv qkv      partials[s] = h @ Wqkv[:, ks]^T           (split-K s, float32 partials)
    rope_kv       q = rope(sum partials); K/V cell of (slot, pos) <- rope(k), v  (FUSE_ROPE: in attn;
                  qkv's ROPE: in qkv's epilogue)
    attn_split    flash-decode over positions 0..pos of the row's own slot, sequence split
                  (exact softmax: a statistics pass first, one more launch)
    attn_combine  merge the splits (skipped when NSPLIT == 1)
    gemv o        partials = o @ Wo^T
    add_norm      x += sum(partials); h = rms_norm(x)
    gemv gate_up  act = silu(h @ Wg^T) * (h @ Wu^T)        (one program reads both halves)
    gemv down     partials = act @ Wdown^T
    ... final add_norm with model.norm, gemv lm_head -> logits [B, vocab] (model dtype)

    FOLD (batch 1): no add_norm; o and down add into the float32 residual atomically, and qkv,
    gate_up and lm_head compute rms_norm(x) * g inside their K loop (x * g per tile, the
    squares summed, the output scaled by the row's rsqrt at the end); one gather kernel first.

Contract kept: `state.weights` and `state.tables` are only read; K/V go only into the cells
(batch.slots[b], batch.positions[b, -1]) of the layers in `state.layers`; attention reads
positions 0..positions[b] only (a loop bound read on the device: no host sync, so the step
is CUDA-graph capturable); nothing is kept across calls (buffers are allocated per call, the
kernels are compiled per shape during the engine's warm-up, no autotuning); any batch size.

With KNOBS["pdl"] (sm_90+) every kernel is launched with programmatic dependent launch: it
starts while the kernel before it runs and waits for it (griddepcontrol.wait) before it reads
anything a kernel wrote; the results are bitwise those of plain launches (tests/test_gpu.py).
What no kernel of the step writes may be loaded before the wait, while the kernel before runs:
the norm weights (always), the first PRE K steps of a GEMV's weight rows, with PRELOAD_KV
each attention split's first block of earlier steps' K/V, with EARLY_INPUTS the step's
position, slot and RoPE rows.

Measured on an H200 (Llama-3.2-1B, bf16, batch 1, context 512, benchmarks/results/):
- The forward run of h200_forward_llama-3.2-1b.json (its `command`), one run: these KNOBS
  1,131 tok/s (885 us a token), llama_triton_decode_h200.py (online softmax, RoPE fused into
  attention, no PRELOAD_KV, EARLY_INPUTS, attention num_stages 1, the norms folded into the
  GEMVs (FOLD), qkv unsplit, combine, o and down EARLY_TRIGGER, qkv PRE 4, o PRE 4, gate_up
  PRE 1, lm_head 16-row tiles reduced at every step, L2 priorities, combine 1 warp, qkv PIPE)
  1,338.6 (747 us; 1,321.0 without qkv PIPE), against the engine reference's 509,
  torch.compile(reduce-overhead)'s 742 and HF's 51 (each step's greedy choice by
  engine_server.greedy); tolerance gate (identical greedy tokens), not bitwise. The run
  before, at 0948e8a (h200_forward_llama-3.2-1b_0948e8a.json), without qkv PIPE: 1,337.0. Before the fold (h200_forward_llama-3.2-1b_e970453.json):
  1,280.0 (781 us).
- How the KNOBS got here: norm num_warps 4 -> 16 (the one program of a batch-1 add_norm is
  latency-bound) and qkv 4 -> 8 (h200_variants_knob_sweep.json, h200_variants_norm_qkv.json);
  then the loads before the wait (h200_variants_preload*.json): the norm weight (+0.8%),
  gate_up reduced at every step with 8 warps (255 registers and 88 bytes of spills with 4 and
  the [BLOCK_N, BLOCK_K] accumulators; +0.8%), down PRE 1 (+0.7%), PRELOAD_KV with exact
  softmax (+1.0%). Slower as measured: PRELOAD_KV with online softmax and fused RoPE (-5.6%;
  on the folded winner -1.7%, h200_variants_fold_attn.json; the block loaded right after the
  wait instead, at 4ecd9d3 and since removed: -2.3% on an H100, h100_variants_preload_wait.json,
  -4.1% on the H200, -3.6% with K and V in one load, h200_variants_attn_subst.json),
  PRE over all of qkv's or o's share of K (the registers it holds push the grid past one
  wave, so the next kernel launches late), EARLY_TRIGGER (-2%). Measured at e066641 and not
  kept (h200_variants_attn_subst.json, _rows_subst.json): this step's K/V row taken from the
  writing program's registers in every tile instead of the block barrier and re-read (-5.2%),
  the q, k, v rows loaded before any arithmetic (a tie), K and V tiles in one load (-0.8%), a
  GEMV's PRE columns summed after its loop (a tie).
- Then for the H200 winner (h200_variants_early_inputs.json, _early_trigger.json,
  _winner_sweep.json): EARLY_INPUTS +1.4%; norm EARLY_TRIGGER with gate_up PRE 1 +1.1% (PRE 1
  alone +0.0%: the early launch is what gives the loads time); weights evict-first in L2
  +1.2%; qkv PRE 4 +0.8% once its kernel launches early. Slower: the attention splits merged
  inside o_proj's GEMV (-7 to -18%), PIPE on gate_up (-5.5%: one program per SM, two waves;
  h200_variants_pipe.json), the combine kernel's early trigger alone (-0.2 to -5%).
- Then (h200_variants_stages*.json): attention num_stages 2 +0.7-0.9%; with it, the combine
  kernel's early trigger and all of o_proj's share of K loaded before the wait (o PRE 4) in
  place of the L2 prefetch of its weight (PREFETCH_O) +1.1%.
- Then (h200_variants_warps*.json): the norms on 32 warps and the combine on one +0.9% (+1.3%
  in the forward run). Slower: other sequence splits (NSPLIT 8, or 32 of 32 keys: -1.4 to
  -2.3%), attention on 2 warps or one stage, any other SPLIT_K of qkv, o or down (-0.3 to -7%).
- The KNOBS below keep exact softmax and the RoPE kernel: with online softmax the shrunk
  preset fails the tolerance gate on the GPU by a near tie (its attention stays within 1-2
  bf16 ulps of exact softmax, but the greedy tokens part at a step where the reference's top
  two logits are one ulp apart: h200_online_softmax_gate.json), and the gate asks for
  identical tokens.
- PDL alone: 1,005 against 921 tok/s without it (h200_variants_pdl.json); L2 prefetches of
  the big GEMVs' weights before the wait cost more than they hide (827 with all of them);
  the norms fused into the GEMVs cost more than their launches (h200_variants_fuse_norm*.json).
- The residual add and norm in the last program of the o and down GEMVs (a ticket atomic per
  program, the last one adds and norms; 99 kernels a step instead of 131; measured at f690ba6,
  then removed): 1,238 against 1,272 tok/s on the H200 winner (h200_variants_in_gemv.json):
  each of their 512 programs takes a ticket on one counter, and the last one's add and norm
  run on the GEMV's 4-8 warps where the norm kernel has 32.
- gate_up launched earlier, to load more of its rows while the attention, combine and norm
  run (o's and the attention's kernels triggering at entry; gate_up PRE 2 or 4): 1,142-1,258
  against 1,272 tok/s, o's early trigger alone 1,274 (h200_variants_early_gemv.json): the
  waiting kernels hold registers and warp slots that the kernels they overlap need.
- Fewer, wider attention splits (h200_variants_attn_wide.json): NSPLIT 4 or 2 1,231 and
  1,214, NSPLIT 1 with 256- or 512-key tiles (no combine kernel) 1,071-1,150 against 1,259:
  one program per kv head cannot pull 128 KB of K/V fast enough (15-19 us a layer).
- The add and norm made inside the next GEMV (NORM_IN at bce73e1, since removed: after its
  wait each program sums the residual and partials for the row's rsqrt and makes each K step's
  columns of h itself): gate_up 1,195, qkv 1,204, both 1,140 against 1,259-1,261 tok/s
  (h200_variants_norm_in.json): making h's columns slows the weight stream more than the norm
  kernel costs. And the order of a GEMV step's loads matters: with the weight tile's load
  issued before the x tile's the same KNOBS ran at 769 tok/s, gate_up at 1.68 TB/s
  (h200_variants_load_order.json); _gemv_tiles loads x first.
- The norms folded into the GEMVs (KNOBS["norm"]["FOLD"], h200_variants_fold*.json): no norm
  kernels (98 a step, not 130); the residual stream in float32, o and down adding into it
  atomically; each GEMV after a norm multiplies its x tiles by the norm weight, sums their
  squares and scales its output by the row's rsqrt at the end. 1,277.6 against 1,260.7 tok/s
  alone, 1,292.3 with o's and down's early triggers (qkv and gate_up now follow them), 1,310.8
  with qkv unsplit (its programs sum the squares in their own loop, not from a separate load of
  the row); then lm_head BLOCK_N 16 with REDUCE_EACH and attention num_stages 1, 1,333-1,335
  against 1,320-1,322 (h200_variants_fold_confirm.json). The gate: tolerance, the logits' error
  1.89 against the bf16 reference's 1.79 (0.57 of the bound; 1.78 before), tokens identical.
  Slower on top of it: the attention splits merged inside o_proj (one program per row block
  and head, no combine kernel; o's MERGE at c1dab03, since removed): 1,296-1,310 against
  1,332-1,337 tok/s (h200_variants_fold_merge_o.json).
- Whole tiles of gate_up's first programs pulled into L2 by bulk prefetches while the attention
  chain runs (the first 1,024-4,096 rows of each half, from the first attention kernel, qkv or
  o_proj; GATE_UP_ROWS before KNOBS["l2"]["GATE_UP_STEPS"] replaced it): 1,250-1,321 against
  1,338 tok/s, slower the more rows (h200_variants_l2_tiles.json): those programs finish early
  but gate_up lasts as long as the other programs' chains of K steps (0.2 us a layer saved),
  while the prefetch traffic stretches qkv by 2 us. Also slower (h200_variants_next_a3e0236.json):
  GATE_UP_STEPS (the next K steps of every row, from qkv or o_proj) -2.3 to -4.6%, END_QKV and
  END_DOWN (the next GEMV's weight pulled into L2 as the programs of the one before finish)
  -3.8% and -5.8%, PIPE with a group's maxnreg (gate_up 128, down 64) -0.5 to -5.9%.
- The MLP in one kernel (KNOBS["mlp"]["FUSED"], on an H100, h100_variants_mlp_fused.json):
  994.0 against 1,054.3 tok/s; the kernel ends 37.5 us after o_proj against 35.0 for gate_up
  and down, its 0.5M float32 atomics a layer costing more than the link it saves. With down
  read from prepare's transposed copy (DOWN_T, +512 MiB; h100_variants_mlp_fused_down_t.json):
  705.1 against 1,038 tok/s.
- RoPE and the K/V write in qkv's kernel (KNOBS["qkv"]["ROPE"], on an H100,
  h100_variants_qkv_rope.json): 1,050.0-1,050.9 against 1,054.9-1,056.0 tok/s; the attention
  kernel, now only loads and arithmetic after its wait, ends 4.89 us after qkv against 4.94 with
  its RoPE, cache write and barrier, and qkv ends 0.55 us later.
- qkv in shared memory (KNOBS["qkv"]["SMEM"], Gluon, on an H100, h100_variants_qkv_smem.json):
  985.7 ("async") and 979.3 ("tma") against 1,055.6-1,056.6 tok/s; qkv ends 4.91 us after down
  against 6.27, but down runs 1.9 us longer beside its copies and gate_up 1.5 us.
- The attention's splits summed with atomics in place of the combine kernel (KNOBS["combine"]
  ["IN_O"], on an H100, h100_variants_in_o.json): 1,000.0 against 1,040.0-1,041.1 tok/s (999.1
  without o_proj's fallback); o_proj ends 1.45 us later after the attention than after the
  combine, about what the attention's 33K contended float32 atomics take to drain.

KNOBS are plain literals so a hill-climb can edit them as text. KNOBS["stages"] switches
each group of kernels off (back to PyTorch) independently: the same file is the ladder
attention-only -> +norm -> +gemv (see make_ladder.py next to it).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine_server.models import llama as ref
from engine_server.models.common import apply_rope, attention as ref_attention, lm_head_weight

KNOBS = {
    # GEMV per projection. BLOCK_N weight rows per program, BLOCK_K columns per loop step,
    # SPLIT_K programs along K (float32 partials summed by the next kernel; gate_up and
    # lm_head must keep 1), num_warps / num_stages as Triton launch options; with PDL, each
    # program prefetches its first PF_STEPS K steps of weight rows into L2 before it waits;
    # PRE: K steps of its weight rows loaded into registers before the wait (a power of two,
    # at most its share of K): the loads are in flight while the kernel before it runs.
    # PIPE: each K step's tiles are loaded one step ahead (two steps in flight per program).
    # maxnreg (optional): a cap on the kernel's registers a thread (a Triton launch option), so
    # that more of its programs fit on a multiprocessor.
    # DOT_BLOCK_N (optional): weight rows a program on the tl.dot path (batched rows, at least
    # 16), where BLOCK_N tiles the batch-1 path; BLOCK_N where absent.
    # LOOP_STAGES (optional, 0 off): the K loop software-pipelined that deep by Triton (cp.async
    # into shared memory, steps in flight without registers holding them). The launch's
    # num_stages alone leaves the batch-1 (FMA) loop unpipelined: compiled for sm_90, its
    # loads are plain global loads at any num_stages.
    # qkv's SMEM (batch 1 with the norm folded, on CUDA; Gluon): each program copies its BLOCK_N
    # rows of qkv's weight whole into shared memory before its wait ("async": cp.async, 16 bytes
    # a thread a copy, evict-first with the L2 knob; "tma": bulk tensor copies, one thread
    # issuing [BLOCK_N, BLOCK_K] boxes) and sums them from there after it, its registers free of
    # them (so more of its programs fit beside the kernel before); BLOCK_K the columns of a copy
    # and a step, num_warps its warps. PRE, PIPE and SPLIT_K unused; without CUDA or Gluon it
    # is the Triton GEMV as if off.
    # qkv's ROPE (batch 1, FMA GEMV, SPLIT_K 1): qkv's programs RoPE their q and k rows and write
    # q, and this step's K/V cell, themselves (each program's rows are the rotate-half pairs
    # of one head), so the attention kernel loads q and its K/V tiles at once after its wait:
    # no RoPE kernel, no RoPE or cache write in attention (FUSE_ROPE unused)
    "qkv": {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3, "PF_STEPS": 0, "PRE": 0,
            "PIPE": False, "ROPE": False, "SMEM": False},
    "o": {"BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3, "PF_STEPS": 0, "PRE": 0,
          "PIPE": False},
    "gate_up": {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 8, "num_stages": 3, "PF_STEPS": 0, "PRE": 0,
                "REDUCE_EACH": True, "PIPE": False},
    "down": {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4, "num_warps": 8, "num_stages": 3, "PF_STEPS": 0, "PRE": 1,
             "PIPE": False},
    "lm_head": {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3, "PF_STEPS": 0, "PRE": 0,
                "PIPE": False},
    # rows >= this use tl.dot on a 16-row padded tile (weights read once for all rows);
    # below it, a float32 FMA reduction (B == 1)
    "gemv_dot_min_rows": 2,
    "gemv_dot_block_b": 16,  # rows per program on the tl.dot path (>= 16)
    # FMA path (B == 1): reduce each [BLOCK_N, BLOCK_K] product along K at every step into a
    # [BLOCK_N] accumulator (fewer registers: room for larger tiles) instead of once at the end;
    # a projection's own "REDUCE_EACH" overrides it
    "gemv_reduce_each_step": False,
    # attention: keys per loop step, sequence splits (1: no combine kernel). EXACT_SOFTMAX
    # rounds the probabilities where the reference does (normalised, then cast): one more
    # pass over K (and, with NSPLIT > 1, one more launch); False: online softmax (flash).
    # FUSE_ROPE: RoPE and this step's K/V write move into the first attention kernel (no
    # _rope_kv_kernel launch). PRELOAD_KV: each split's first block of K/V (earlier steps' cells)
    # is loaded before the PDL wait, the row of this step's position re-read after it.
    # EARLY_INPUTS: the step's position, slot and RoPE table rows are loaded before the wait.
    # CLUSTER (batch 1, bf16, online softmax, FUSE_ROPE; CUDA, compute capability 9.0+): the
    # attention and its combine as one Gluon kernel (_attn_cluster_kernel), a cluster of NSPLIT
    # CTAs per kv head, the splits' partials merged after a cluster barrier: no combine launch
    "attn": {"BLOCK_S": 64, "NSPLIT": 16, "EXACT_SOFTMAX": True, "FUSE_ROPE": False, "num_warps": 4,
             "num_stages": 4, "PRELOAD_KV": True, "EARLY_INPUTS": False, "CLUSTER": False},
    # EARLY_TRIGGER (with PDL): this group's kernels let the next kernel launch at their entry
    # (as KNOBS["pdl"]["EARLY_TRIGGER"] does for all), so its loads before the wait (PRE) start
    # a kernel earlier; the next kernel still waits for this one's results. The GEMV groups
    # (qkv, o, gate_up, down, lm_head) and "attn" take the same key (off where absent)
    # IN_O (with FOLD; online softmax, NSPLIT > 1, no CLUSTER): no combine kernel. Each split
    # also adds its partial, weighted by exp(m_s - M) for a reference M that every split of a
    # head computes alike (the larger of the scores of this step's key and of key 0), into one
    # float32 sum per head and its denominator (atomics; qkv zeroes them); o_proj divides as it
    # loads its x. Where a split's max is above M by more than 60 (its weight would near float32's
    # range; it sets a flag) o_proj merges the splits' stored partials instead
    "combine": {"num_warps": 2, "EARLY_TRIGGER": False,
                "IN_O": False},
    # FOLD (batch 1, FMA GEMVs): no norm kernels. The residual stream stays in float32, o and
    # down add into it atomically, and qkv, gate_up and lm_head fold the norm before them into
    # their K loop (x * g, the squares summed, the output scaled by the row's rsqrt at the end);
    # not rounded where the reference rounds (the tolerance gate's concern)
    "norm": {"num_warps": 16, "EARLY_TRIGGER": False, "FOLD": False},
    # FUSED (with FOLD): gate_up and down in one kernel. Each program makes gate_up's BLOCK_N
    # rows of silu(gate) * up (gate_up's KNOBS), then multiplies them by the same columns of
    # down and adds that [D] partial into the next residual buffer atomically (its program 0
    # adds the residual itself; the next layer's qkv zeroes the buffer after this one): no down
    # launch and no activation buffer. DOWN_PRE: the first down tile is loaded before the wait.
    # EARLY_TRIGGER as the GEMV groups' (the next qkv launches at this kernel's entry).
    # DOWN_T: down read from a transposed copy that prepare makes ([intermediate, hidden]: a
    # program's rows of it contiguous, 512-byte runs instead of 2 * BLOCK_N bytes a row)
    "mlp": {"FUSED": False, "DOWN_PRE": False, "EARLY_TRIGGER": True, "DOWN_T": False},
    # FUSED (with FOLD; CUDA, compute capability 9.0+): o_proj and gate_up as one Gluon kernel
    # (_o_gate_up_kernel) whose programs, all resident at once, copy their o rows and gate_up's
    # first EARLY stages (STAGE_K columns of their BLOCK_N gate and up rows each) into shared
    # memory before their PDL wait (while the attention chain leaves the memory idle), add o's
    # rows into x, meet at a grid barrier, then stream the rest of gate_up through that ring of
    # STAGES stages.
    # SPIN_LIMIT: a barrier's polls before it gives up (wrong results, never a hang).
    # EARLY_TRIGGER as the GEMV groups' (down launches at this kernel's entry)
    "o_gate_up": {"FUSED": False, "BLOCK_N": 64, "STAGE_K": 256, "STAGES": 2, "EARLY": 2, "num_warps": 4,
                  "EARLY_TRIGGER": True, "SPIN_LIMIT": 65536},
    "rope": {"num_warps": 2},
    # programmatic dependent launch (sm_90+, CUDA graphs keep it): each kernel is launched while
    # the one before it runs and waits for it (griddepcontrol.wait) only before it reads anything
    # a kernel writes. PREFETCH_O: the first attention kernel pulls o_proj's weight into L2
    # before it waits (weights are never written; see also the GEMVs' PF_STEPS and PRE).
    # EARLY_TRIGGER: each kernel lets the next one launch at its entry instead of after its
    # wait, so loads issued before the wait run a kernel further ahead.
    "pdl": {"enabled": True, "PREFETCH_O": False, "EARLY_TRIGGER": False},
    # L2 eviction priorities: the GEMVs' weight loads marked evict-first (each is read once a
    # step), the attention's K/V loads evict-last (read again next step), so the K/V cache and
    # the step's activations may stay in L2 while the weights stream past
    # GATE_UP_STEPS (with PDL): every row of the layer's gate_up weight has its GATE_UP_STEPS
    # K steps after gate_up's PRE pulled into L2 by bulk prefetches (cp.async.bulk.prefetch,
    # one instruction per row) from the kernel BY ("qkv", "attn": the first attention kernel,
    # or "o"), AT its "entry" or right after its "wait": each gate_up program's chain of loads
    # is shorter, and that part of the weight streams while the attention chain runs.
    # END_DOWN / END_QKV (with PDL): as each gate_up program finishes it pulls its share of the
    # layer's down weight into L2 (bulk prefetches, whole rows), and each down program its
    # share of the next layer's qkv weight: the next GEMV's programs, which mostly cannot be
    # resident beside this one's, find their weights in L2 while this one's last programs run
    # QKV_NEXT (with PDL): the first attention kernel pulls the next layer's whole qkv weight
    # into L2 AT its "entry" or right after its "wait" (in place of GATE_UP_STEPS), while the
    # memory is idle; with the weights streamed evict-first it may stay there until the next
    # qkv, whose programs mostly cannot be resident (and load early) beside down's
    "l2": {"WEIGHTS_EVICT_FIRST": False, "KV_EVICT_LAST": False, "GATE_UP_STEPS": 0, "BY": "attn", "AT": "wait",
           "END_DOWN": False, "END_QKV": False, "QKV_NEXT": False},
    "stages": {"attention": True, "norm": False, "gemv": False},
}

try:  # Triton is optional: without it every call runs the reference
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install
    HAVE_TRITON = False

try:  # Gluon (Triton's explicit-layout dialect): KNOBS["qkv"]["SMEM"], KNOBS["o_gate_up"], on CUDA
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _gl_cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier as _gl_mb, tma as _gl_tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # names that moved between Triton releases: 3.6's, or later ones'
    _gl_copy = _gl_cp.async_load if hasattr(_gl_cp, "async_load") else _gl_cp.async_copy_global_to_shared
    _gl_tma_load = _gl_tma.async_load if hasattr(_gl_tma, "async_load") else _gl_tma.async_copy_global_to_shared
    _gl_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # (the CTA's threads)
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared as _gl_fence
    HAVE_GLUON = HAVE_TRITON
except Exception:  # noqa: BLE001 - an older Triton, or none
    HAVE_GLUON = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _supported(state, batch) -> bool:
    """Decode on a device Triton can run, for the model features the kernels implement."""
    cfg = state.config
    if not HAVE_TRITON or batch.seq_len != 1:
        return False
    if state.device.type != "cuda" and not _interpreting():
        return False
    if cfg.is_moe or cfg.attention_bias or cfg.qk_norm or cfg.hidden_act != "silu":
        return False
    hd = cfg.head_dim
    return hd % 2 == 0 and (hd & (hd - 1)) == 0 and cfg.num_heads % cfg.num_kv_heads == 0


def prepare(state):
    """KNOBS["mlp"]["FUSED"] with DOWN_T: each layer's down weight transposed once, into
    state.scratch["down_t.{layer}"] ([intermediate, hidden], contiguous); nothing otherwise."""
    if KNOBS["mlp"]["FUSED"] and KNOBS["mlp"]["DOWN_T"]:
        for layer in state.layers:
            down = state.weights[f"model.layers.{layer}.mlp.down_proj.weight"]
            state.scratch[f"down_t.{layer}"] = down.t().contiguous()


def forward(state, batch):
    if not _supported(state, batch):
        return ref.forward(state, batch)
    return _decode(state, batch)


# ---- kernels ---------------------------------------------------------------------------

if HAVE_TRITON:

    # The Triton interpreter (TRITON_INTERPRET=1, CPU tests) casts float32 -> bfloat16 by
    # truncation and multiplies bfloat16 tiles as raw integers in tl.dot; with _INTERP set
    # the kernels round to nearest even in software and feed tl.dot float32. No effect on GPU.
    _INTERP = tl.constexpr(_interpreting())

    @triton.jit
    def _to(x, like_ptr):
        """float32 `x` cast to the element type of `like_ptr`, round to nearest even."""
        if _INTERP:
            if like_ptr.dtype.element_ty == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                x = bits.to(tl.float32, bitcast=True)
        return x.to(like_ptr.dtype.element_ty)

    @triton.jit
    def _round(x, like_ptr):
        """Round float32 `x` to the element type of `like_ptr` and back (the reference's
        rounding point between two ops); a no-op for float32 models."""
        return _to(x, like_ptr).to(tl.float32)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b with float32 accumulation (IEEE: no TF32 for float32 operands)."""
        if _INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _pdl_enter(PDL: tl.constexpr):
        """At kernel entry. PDL == 2 (KNOBS["pdl"]["EARLY_TRIGGER"], or the kernel group's own
        EARLY_TRIGGER): let the next kernel launch now, so it can load its weights while this
        one runs (it still waits for this one's results: griddepcontrol.wait waits for the
        whole grid before it, which waited for its own)."""
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _pdl_wait(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one to finish (its writes visible); PDL == 1
        then lets the next kernel launch. Nothing a kernel writes may be read before this; only
        weights, tables and the step's inputs (tokens, positions, slots) and cache cells of
        earlier steps may (no kernel of the step writes them)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if PDL == 1:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _prefetch(ptrs):
        """Pull the lines at `ptrs` into L2: a hint, no result (callers clamp to valid addresses)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_rows(base, rows, stride, nbytes, pid, nprog, CH: tl.constexpr):
        """Program pid of nprog's share of a bulk L2 prefetch of `nbytes` (a multiple of 16)
        at base + r * stride (bytes, 16-byte aligned) for each row r < rows: one
        cp.async.bulk.prefetch (sm_90, a hint) per row, CH rows (one a thread) at a time.
        Weights only."""
        per = tl.cdiv(rows, nprog)
        lo = pid * per
        hi = tl.minimum(lo + per, rows)
        b8 = base.to(tl.pointer_type(tl.int8))
        for j0 in range(lo, hi, CH):
            r = j0 + tl.arange(0, CH)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                "mov.u32 $0, 0; }", "=r,l,r,r",
                [b8 + r.to(tl.int64) * stride, nbytes + 0 * r, (r < hi).to(tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _add_branch(x, br_base, offs, m, NBR, stride_br_s, like_ptr, BLOCK: tl.constexpr):
        """x + the sum over s < NBR of the branch partials at br_base + s * stride_br_s + offs
        (any dtype), the branch rounded to like_ptr's dtype before the add and the sum after
        it, as `x + linear(...)` rounds: float32."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, NBR):
            acc += tl.load(br_base + s * stride_br_s + offs, mask=m, other=0.0).to(tl.float32)
        return _round(x + _round(acc, like_ptr), like_ptr)

    @triton.jit
    def _add_norm_kernel(x_ptr, h_ptr, br_ptr, w_ptr, tok_ptr, emb_ptr,
                         D, NBR, stride_br_s, stride_br_b, stride_tok, stride_emb, eps,
                         GATHER: tl.constexpr, HAS_BRANCH: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr, NORM: tl.constexpr):
        """One program per row b (x, h: [B, D] contiguous, model dtype).

        GATHER: x[b] = emb[tok[b]] first (the embedding lookup). HAS_BRANCH: x[b] += the sum
        over s < NBR of br[s, b] (split-K partials, any dtype), the branch rounded to the
        model dtype before the add and the sum after it, as `x + linear(...)` rounds.
        Then h[b] = x[b] * rsqrt(mean(x[b]^2) + eps) * w, rounded once (NORM; without it x
        only: the first kernel of a step whose GEMVs fold the norms in).
        """
        _pdl_enter(PDL)
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        if NORM:
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)  # a weight: before the wait
        _pdl_wait(PDL)
        if GATHER:
            tok = tl.load(tok_ptr + b * stride_tok)
            x = tl.load(emb_ptr + tok * stride_emb + offs, mask=m, other=0.0).to(tl.float32)
            if not HAS_BRANCH:
                tl.store(x_ptr + b * D + offs, _to(x, x_ptr), mask=m)
        else:
            x = tl.load(x_ptr + b * D + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BRANCH:
            x = _add_branch(x, br_ptr + b * stride_br_b, offs, m, NBR, stride_br_s, x_ptr, BLOCK_D)
            tl.store(x_ptr + b * D + offs, _to(x, x_ptr), mask=m)
        if NORM:
            var = tl.sum(x * x, axis=0) / D
            r = 1.0 / tl.sqrt(var + eps)
            tl.store(h_ptr + b * D + offs, _to(x * r * w, h_ptr), mask=m)

    @triton.jit
    def _gemv_tiles(x_rows, w_rows, wu_rows, k0, K, n_mask, b_mask, EVEN_K: tl.constexpr, SILU: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVW: tl.constexpr):
        """The tiles of K step k0 of a GEMV: x [BLOCK_B, BLOCK_K], w and (SILU) up rows
        [BLOCK_N, BLOCK_K]; zeros past K and past the masked rows. Without SILU the third is x.
        EVW: the weight loads' L2 eviction policy ("" default, or "evict_first")."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            wm = n_mask[:, None]
            xm = b_mask[:, None]
        else:
            k_mask = offs_k < K
            wm = n_mask[:, None] & k_mask[None, :]
            xm = b_mask[:, None] & k_mask[None, :]
        # x before w: with the weight tile's load issued first, gate_up ran at half its
        # bandwidth on the H200 (h200_variants_load_order.json)
        xt = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        wt = tl.load(w_rows + offs_k[None, :], mask=wm, other=0.0, eviction_policy=EVW)
        if SILU:
            wu = tl.load(wu_rows + offs_k[None, :], mask=wm, other=0.0, eviction_policy=EVW)
        else:
            wu = xt
        return xt, wt, wu

    @triton.jit
    def _down_tile(d_rows, c0, K, stride_dn, n_mask, BLOCK_K: tl.constexpr, EVW: tl.constexpr):
        """The down weight's [BLOCK_N, BLOCK_K] tile of output columns c0.. for the program's
        intermediate rows (d_rows: their [BLOCK_N, 1] pointers); zeros past K (none loaded)."""
        cols = c0 + tl.arange(0, BLOCK_K)
        m = n_mask[:, None] & (cols < K)[None, :]
        return tl.load(d_rows + cols.to(tl.int64)[None, :] * stride_dn, mask=m, other=0.0, eviction_policy=EVW)

    @triton.jit
    def _folded(xt, g_ptr, offs_k, K, EVEN_K: tl.constexpr):
        """A float32 residual tile [1, n] at columns offs_k -> (x * g, x * x): the norm weight
        g's columns applied, the squares for the row's rsqrt (zeros past K)."""
        if EVEN_K:
            gt = tl.load(g_ptr + offs_k)
        else:
            gt = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0)
        xf = xt.to(tl.float32)
        return xf * gt.to(tl.float32)[None, :], xf * xf

    @triton.jit
    def _attn_x(xt, c0, K, den_ptr, po_ptr, pm_ptr, pl_ptr, o_ptr, HD: tl.constexpr, NS: tl.constexpr,
                NS_P: tl.constexpr, N: tl.constexpr):
        """KNOBS["combine"]["IN_O"], row 0: o_proj's x tile [1, N] at columns c0.. from the
        attention splits' weighted sums there (xt, float32), each divided by its head's
        denominator (den_ptr [H]) and rounded to o_ptr's dtype (the model's), as the combine
        kernel stores o. Where a split flagged a weight past exp(60) (den_ptr[K // HD] set: a
        score far above its head's reference), the program merges the tile's heads from the
        splits' partials (po [H, NS, HD], pm / pl [H, NS], float32) as _attn_combine_kernel
        does, into o_ptr [K] (every program writes the same values there), and reads the tile
        back after a block barrier: one head at a time, so the registers it holds stay few."""
        cols = c0 + tl.arange(0, N)[None, :]
        c = tl.minimum(cols, K - 1)
        x = _round(xt.to(tl.float32) / tl.load(den_ptr + c // HD), o_ptr)
        if tl.load(den_ptr + K // HD) != 0.0:
            s = tl.arange(0, NS_P)
            sm = s < NS
            d = tl.arange(0, HD)
            for hh in range(c0 // HD, (tl.minimum(c0 + N, K) + HD - 1) // HD):
                row = hh * NS + s
                m = tl.load(pm_ptr + row, mask=sm, other=float("-inf"))
                wgt = tl.where(sm, tl.exp(m - tl.max(m, axis=0)), 0.0)
                acc = tl.load(po_ptr + row[:, None] * HD + d[None, :], mask=sm[:, None], other=0.0)
                den = tl.sum(tl.load(pl_ptr + row, mask=sm, other=0.0) * wgt, axis=0)
                out = tl.sum(acc * wgt[:, None], axis=0) / den
                tl.store(o_ptr + hh * HD + d, _to(out, o_ptr))
            tl.debug_barrier()  # the block's own writes, visible to its loads below
            x = tl.load(o_ptr + c).to(tl.float32)
        return x

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, B, N, K, K_SPLIT, N_UP,
                     stride_xb, stride_wn, stride_os, stride_ob,
                     SILU: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                     REDUCE_EACH: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, PF_STEPS: tl.constexpr, PF_W: tl.constexpr, PRE_K: tl.constexpr,
                     PIPE: tl.constexpr, EVW: tl.constexpr, LOOP_STAGES: tl.constexpr,
                     g_ptr, eps, FOLD: tl.constexpr, SS_ROW: tl.constexpr, BLOCK_D: tl.constexpr,
                     ATOMIC: tl.constexpr, l2_ptr, l2_rows, l2_stride, l2_bytes, L2_AT: tl.constexpr,
                     L2_CH: tl.constexpr, wd_ptr, stride_dj, stride_dn, DOWN: tl.constexpr,
                     DOWN_PRE: tl.constexpr, z_ptr, Z_BLOCK: tl.constexpr,
                     ROPE: tl.constexpr, q_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                     stride_cos, s_slot, s_head, s_seq, RH: tl.constexpr, RKV: tl.constexpr, RHD: tl.constexpr,
                     z_n, den_ptr, po_ptr, pm_ptr, pl_ptr, xo_ptr, XH: tl.constexpr, XNS: tl.constexpr,
                     XNS_P: tl.constexpr):
        """out[s, b, n] = sum over k in split s of x[b, k] * w[n, k]  (w: [N(+N_UP), K] rows).

        Grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(B, BLOCK_B)). Each program streams its
        BLOCK_N weight rows once for all of its BLOCK_B rows of x. USE_DOT: tl.dot on a
        [BLOCK_B, BLOCK_K] x [BLOCK_K, BLOCK_N] tile (BLOCK_B >= 16, padding rows masked);
        else BLOCK_B == 1 and a float32 multiply-accumulate reduced once at the end (REDUCE_EACH:
        reduced along K at every step into a [BLOCK_N] accumulator).
        SILU (SPLIT_K == 1): also reads rows n + N_UP and stores silu(gate) * up, with the
        reference's roundings (gate, up, silu(gate), product). Accumulation is float32; the
        store casts to out's dtype (float32 partials, or the model dtype).
        PDL: before waiting for the kernel before it, the program prefetches its first PF_STEPS
        K steps of weight rows (PF_W lines of a row per step) into L2.
        PRE_K > 0 (a power of two, <= K_SPLIT): the program loads its first PRE_K columns of
        weight rows into registers before the wait (with PDL, while the kernel before it
        runs), their products summed apart from the loop's and added at the end.
        PIPE: each K step's loads are issued one step ahead (registers double-buffered), so a
        program has two steps of weight rows in flight while it sums one.
        EVW: the weight loads' L2 eviction policy ("" default, or "evict_first").
        LOOP_STAGES > 0: the K loop is software-pipelined that deep (tl.range's num_stages):
        its loads go to shared memory by cp.async, LOOP_STAGES - 1 steps ahead, not through
        registers (the launch's num_stages alone leaves this loop unpipelined).
        FOLD (B == 1, the FMA path; KNOBS["norm"]["FOLD"]): x is the float32 residual stream and
        the GEMV is of rms_norm(x) * g (norm weight g): each K step's x tile is multiplied by g's
        and its squares summed, and the output scaled by rsqrt(sum / K + eps) at the end (a
        row's scale is common to all its products, so no pass over x comes first). SS_ROW (a
        split of K): the squares are summed over the whole row, loaded at once after the wait.
        ATOMIC (B == 1): the program adds its partial into out[b, n] (float32: the residual
        stream) instead of storing partials for the next kernel to sum.
        L2_AT 1 (at entry), 2 (after the wait) or 3 (at the end): the programs share out a bulk
        L2 prefetch of l2_bytes at l2_ptr + r * l2_stride for r < l2_rows (a later kernel's
        weight rows).
        DOWN (SILU, FOLD; KNOBS["mlp"]["FUSED"]): the BLOCK_N rows of silu(gate) * up are not
        stored but multiplied by the same columns of the down weight (element (j, n) at
        wd_ptr + j * stride_dj + n * stride_dn, n < K) and added into out[n] atomically, program
        0 adding x[n] too (out: the next float32 residual, zeros before). DOWN_PRE: the first
        [BLOCK_N, BLOCK_K] down tile is loaded before the wait.
        Z_BLOCK > 0: program 0 zeroes z_ptr[:z_n] after the wait (a buffer a later kernel adds
        into: the fused MLP's residual, IN_O's attention sums; Z_BLOCK a power of two >= z_n).
        XH > 0 (B == 1, the FMA path; KNOBS["combine"]["IN_O"]): x is the attention splits' sums
        [H * XH] (float32), each x tile divided by its heads' denominators after its load
        (_attn_x: den_ptr, and the XNS splits' partials po_ptr, pm_ptr, pl_ptr to fall back on,
        merged into xo_ptr, the model-dtype attention output; XNS_P a power of two >= XNS).
        ROPE (B == 1, SPLIT_K == 1, the FMA path; w the qkv weight of RH q heads, then RKV k and
        RKV v heads of RHD dims, BLOCK_N even and dividing RHD): program n's rows are dims
        j*BLOCK_N/2 + i and the same + RHD/2 (i < BLOCK_N/2) of head n // (RHD / BLOCK_N), so each
        row's rotate-half partner is in the program. Nothing goes to out: each row is rounded to
        the model dtype as the reference's projection output is, q and k rows RoPE'd as
        common.apply_rope rounds (each product, then their sum; table rows cos_ptr / sin_ptr at
        pos_ptr[0], loaded before the wait: step inputs), and stored: q rows into q_ptr [RH*RHD],
        k and v rows into the cache cell (slot_ptr[0], head, pos_ptr[0]) of kc_ptr / vc_ptr.
        """
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_b = tl.program_id(2)
        if ROPE:  # one head's rotate-half pairs: dims j*BLOCK_N/2 + i and that + RHD/2
            ri = tl.arange(0, BLOCK_N)
            r_head = pid_n // (RHD // BLOCK_N)
            half = ri // (BLOCK_N // 2)  # 0: the first half's dims, 1: their partners
            r_dim = (pid_n % (RHD // BLOCK_N)) * (BLOCK_N // 2) + ri % (BLOCK_N // 2) + (RHD // 2) * half
            offs_n = r_head * RHD + r_dim
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        b_mask = offs_b < B
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        wu_rows = w_rows + N_UP * stride_wn
        x_rows = x_ptr + offs_b.to(tl.int64)[:, None] * stride_xb
        k_lo = pid_k * K_SPLIT
        _pdl_enter(PDL)
        l2_pid = (pid_b * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_n
        l2_nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        if L2_AT == 1:
            _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)
        if PRE_K > 0:  # weights only: no kernel writes them
            offs_p = k_lo + tl.arange(0, PRE_K)
            if EVEN_K:
                pm = n_mask[:, None]
            else:
                pm = n_mask[:, None] & (offs_p < K)[None, :]
            wp = tl.load(w_rows + offs_p[None, :], mask=pm, other=0.0, eviction_policy=EVW)  # [BLOCK_N, PRE_K]
            if SILU:
                wpu = tl.load(wu_rows + offs_p[None, :], mask=pm, other=0.0, eviction_policy=EVW)
        if ROPE:  # the step's position, slot and RoPE table rows: inputs, no kernel writes them
            r_pos = tl.load(pos_ptr).to(tl.int32)
            r_slot = tl.load(slot_ptr)
            r_c = tl.load(cos_ptr + r_pos * stride_cos + r_dim).to(tl.float32)
            r_sn = tl.load(sin_ptr + r_pos * stride_cos + r_dim).to(tl.float32)
        if DOWN:
            d_rows = wd_ptr + offs_n.to(tl.int64)[:, None] * stride_dj
            if DOWN_PRE:  # weights only
                dt0 = _down_tile(d_rows, 0, K, stride_dn, n_mask, BLOCK_K, EVW)
        if PDL:
            if PF_STEPS > 0:  # weights only: no kernel writes them
                rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
                lines = tl.arange(0, PF_W) * (BLOCK_K // PF_W)
                for j in range(0, PF_STEPS):
                    kk = tl.minimum(k_lo + j * BLOCK_K + lines, K - 1)[None, :]
                    _prefetch(w_ptr + rows + kk)
                    if SILU:
                        _prefetch(w_ptr + N_UP * stride_wn + rows + kk)
        _pdl_wait(PDL)
        if Z_BLOCK > 0:  # the next residual buffer: its last reader ended before this wait
            offs_z = tl.arange(0, Z_BLOCK)
            tl.store(z_ptr + offs_z, tl.zeros([Z_BLOCK], dtype=tl.float32),
                     mask=(offs_z < z_n) & (offs_z * 0 + l2_pid == 0))
        if L2_AT == 2:
            _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)
        if FOLD:
            if SS_ROW:  # the whole row, for its sum of squares (summed at the end)
                offs_d = tl.arange(0, BLOCK_D)
                xrow = tl.load(x_ptr + offs_d, mask=offs_d < K, other=0.0)
            else:
                ss = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        if USE_DOT:
            acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        elif REDUCE_EACH:
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc1_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc2_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PRE_K > 0:
            if EVEN_K:
                xpm = b_mask[:, None]
            else:
                xpm = b_mask[:, None] & (offs_p < K)[None, :]
            xp = tl.load(x_rows + offs_p[None, :], mask=xpm, other=0.0)  # [BLOCK_B, PRE_K]
            if XH > 0:
                xp = _attn_x(xp, k_lo, K, den_ptr, po_ptr, pm_ptr, pl_ptr, xo_ptr, XH, XNS, XNS_P, PRE_K)
            if FOLD:
                xp, ssp = _folded(xp, g_ptr, offs_p, K, EVEN_K)
                if not SS_ROW:
                    ss_pre = tl.sum(ssp, axis=1)  # [1]
            if USE_DOT:
                acc += _dot(xp, tl.trans(wp), IEEE)
                if SILU:
                    acc_u += _dot(xp, tl.trans(wpu), IEEE)
            else:
                xpf = xp.to(tl.float32)
                pre = tl.sum(wp.to(tl.float32) * xpf, axis=1)  # [BLOCK_N]
                if SILU:
                    pre_u = tl.sum(wpu.to(tl.float32) * xpf, axis=1)
        if PIPE:  # the first K step's tiles (clamped into the split: the loop may have none)
            kc = tl.minimum(k_lo + PRE_K, k_lo + K_SPLIT - BLOCK_K)
            xt_n, wt_n, wu_n = _gemv_tiles(x_rows, w_rows, wu_rows, kc, K, n_mask, b_mask, EVEN_K, SILU, BLOCK_K, EVW)
        for k0 in tl.range(k_lo + PRE_K, k_lo + K_SPLIT, BLOCK_K,
                           num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
            if PIPE:  # this step's tiles arrived last step; the next step's are loaded now
                xt, wt, wu = xt_n, wt_n, wu_n
                kc = tl.minimum(k0 + BLOCK_K, k_lo + K_SPLIT - BLOCK_K)
                xt_n, wt_n, wu_n = _gemv_tiles(x_rows, w_rows, wu_rows, kc, K, n_mask, b_mask, EVEN_K, SILU, BLOCK_K, EVW)
            else:
                xt, wt, wu = _gemv_tiles(x_rows, w_rows, wu_rows, k0, K, n_mask, b_mask, EVEN_K, SILU, BLOCK_K, EVW)
            if XH > 0:
                xt = _attn_x(xt, k0, K, den_ptr, po_ptr, pm_ptr, pl_ptr, xo_ptr, XH, XNS, XNS_P, BLOCK_K)
            if FOLD:
                xt, sst = _folded(xt, g_ptr, k0 + tl.arange(0, BLOCK_K), K, EVEN_K)
                if not SS_ROW:
                    ss += sst
            if USE_DOT:
                acc += _dot(xt, tl.trans(wt), IEEE)
                if SILU:
                    acc_u += _dot(xt, tl.trans(wu), IEEE)
            elif REDUCE_EACH:
                xf = xt.to(tl.float32)
                acc1 += tl.sum(wt.to(tl.float32) * xf, axis=1)
                if SILU:
                    acc1_u += tl.sum(wu.to(tl.float32) * xf, axis=1)
            else:
                xf = xt.to(tl.float32)  # [1, BLOCK_K] broadcasts over the weight rows
                acc2 += wt.to(tl.float32) * xf
                if SILU:
                    acc2_u += wu.to(tl.float32) * xf
        if not USE_DOT:
            if REDUCE_EACH:
                red = acc1
                if SILU:
                    red_u = acc1_u
            else:
                red = tl.sum(acc2, axis=1)
                if SILU:
                    red_u = tl.sum(acc2_u, axis=1)
            if PRE_K > 0:
                red += pre
                if SILU:
                    red_u += pre_u
            acc = red[None, :]  # [1, BLOCK_N]
            if SILU:
                acc_u = red_u[None, :]
        if FOLD:  # the norm's scale, common to the row's products
            if SS_ROW:
                sq = tl.sum(xrow * xrow, axis=0)
            else:
                sq = tl.sum(ss, axis=1)  # [1]
                if PRE_K > 0:
                    sq += ss_pre
            r = 1.0 / tl.sqrt(sq / K + eps)
            acc = acc * r
            if SILU:
                acc_u = acc_u * r
        if SILU:
            g = _round(acc, out_ptr)
            u = _round(acc_u, out_ptr)
            act = _round(g / (1.0 + tl.exp(-g)), out_ptr)
            val = act * u
        else:
            val = acc
        if DOWN:  # these rows' share of down's product, into the next residual
            av = tl.sum(_round(val, wd_ptr), axis=0)[:, None]  # [BLOCK_N, 1]: act, rounded as stored
            if DOWN_PRE:
                dt = dt0
            else:
                dt = _down_tile(d_rows, 0, K, stride_dn, n_mask, BLOCK_K, EVW)
            for c0 in range(0, K, BLOCK_K):
                dn = _down_tile(d_rows, c0 + BLOCK_K, K, stride_dn, n_mask, BLOCK_K, EVW)  # the next (none past K)
                cols = c0 + tl.arange(0, BLOCK_K)
                cm = cols < K
                part = tl.sum(dt.to(tl.float32) * av, axis=0)  # [BLOCK_K]
                part += tl.load(x_ptr + cols, mask=cm & (cols * 0 + l2_pid == 0), other=0.0)  # (a block mask)
                tl.atomic_add(out_ptr + cols, part, mask=cm, sem="relaxed")
                dt = dn
        elif ROPE:  # q and k RoPE'd, then q to q_ptr and this step's k and v to the cache
            xr = _round(tl.sum(val, axis=0), kc_ptr)  # [BLOCK_N]: the projection's output
            partner = (ri + BLOCK_N // 2) % BLOCK_N
            xp = tl.sum(tl.where(partner[:, None] == ri[None, :], xr[None, :], 0.0), axis=1)
            roped = _round(_round(xr * r_c, kc_ptr) + _round(xp * r_sn, kc_ptr), kc_ptr)
            hv = r_head + 0 * ri  # full-shape compares: the interpreter rejects scalar masks
            is_k = (hv >= RH) & (hv < RH + RKV)
            is_v = hv >= RH + RKV
            cell = r_slot.to(tl.int64) * s_slot + r_pos.to(tl.int64) * s_seq + r_dim
            tl.store(q_ptr + tl.minimum(hv, RH - 1) * RHD + r_dim, _to(roped, q_ptr), mask=hv < RH)
            tl.store(kc_ptr + cell + tl.minimum(tl.maximum(hv - RH, 0), RKV - 1) * s_head, _to(roped, kc_ptr),
                     mask=is_k)
            tl.store(vc_ptr + cell + tl.maximum(hv - RH - RKV, 0) * s_head, _to(xr, vc_ptr), mask=is_v)
        elif ATOMIC:  # every split adds into the same row
            out = out_ptr + offs_b.to(tl.int64)[:, None] * stride_ob + offs_n[None, :]
            tl.atomic_add(out, val, mask=b_mask[:, None] & n_mask[None, :], sem="relaxed")
        else:
            out = out_ptr + pid_k * stride_os + offs_b.to(tl.int64)[:, None] * stride_ob + offs_n[None, :]
            tl.store(out, _to(val, out_ptr), mask=b_mask[:, None] & n_mask[None, :])
        if L2_AT == 3:
            _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, q_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                        NP, stride_qkv_s, stride_qkv_b, stride_pos, stride_slot, stride_cos,
                        s_slot, s_head, s_seq,
                        H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                        NH_P: tl.constexpr, KV_P: tl.constexpr, PDL: tl.constexpr):
        """One program per row b. qkv: NP split-K partials [NP, B, (H+2KV)*hd] (summed, then
        rounded to the model dtype as the reference's projection output is).

        q heads -> q[b] (rotated); k heads (rotated) and v heads -> the cache cell
        (slot[b], head, pos[b]) of this layer's k/v cache, and nothing else.
        RoPE as common.apply_rope: x*cos + roll(x, hd/2)*sin_rot, each product and the sum
        rounded (sin: the `rope_sin_rot` table, whose first half carries the minus sign).
        """
        _pdl_enter(PDL)
        _pdl_wait(PDL)
        b = tl.program_id(0)
        pos = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
        slot = tl.load(slot_ptr + b * stride_slot)
        hh = tl.arange(0, NH_P)
        d = tl.arange(0, HALF)
        hm = (hh < H + KV)[:, None]
        lo = tl.zeros([NH_P, HALF], dtype=tl.float32)
        hi = tl.zeros([NH_P, HALF], dtype=tl.float32)
        row = qkv_ptr + b * stride_qkv_b + hh[:, None] * HD + d[None, :]
        for s in range(0, NP):
            lo += tl.load(row + s * stride_qkv_s, mask=hm, other=0.0).to(tl.float32)
            hi += tl.load(row + s * stride_qkv_s + HALF, mask=hm, other=0.0).to(tl.float32)
        lo = _round(lo, kc_ptr)
        hi = _round(hi, kc_ptr)
        c_lo = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)[None, :]
        c_hi = tl.load(cos_ptr + pos * stride_cos + HALF + d).to(tl.float32)[None, :]
        s_lo = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)[None, :]
        s_hi = tl.load(sin_ptr + pos * stride_cos + HALF + d).to(tl.float32)[None, :]
        o_lo = _round(_round(lo * c_lo, kc_ptr) + _round(hi * s_lo, kc_ptr), kc_ptr)
        o_hi = _round(_round(hi * c_hi, kc_ptr) + _round(lo * s_hi, kc_ptr), kc_ptr)
        is_q = (hh < H)[:, None]
        q_out = q_ptr + b * (H * HD) + hh[:, None] * HD + d[None, :]
        tl.store(q_out, _to(o_lo, q_ptr), mask=is_q)
        tl.store(q_out + HALF, _to(o_hi, q_ptr), mask=is_q)
        is_k = hm & (hh >= H)[:, None]
        cell = slot * s_slot + pos * s_seq
        k_out = kc_ptr + cell + (hh - H)[:, None] * s_head + d[None, :]
        tl.store(k_out, _to(o_lo, kc_ptr), mask=is_k)
        tl.store(k_out + HALF, _to(o_hi, kc_ptr), mask=is_k)
        vh = tl.arange(0, KV_P)
        dd = tl.arange(0, HD)
        vm = (vh < KV)[:, None]
        vrow = qkv_ptr + b * stride_qkv_b + (H + KV) * HD + vh[:, None] * HD + dd[None, :]
        v = tl.zeros([KV_P, HD], dtype=tl.float32)
        for s in range(0, NP):
            v += tl.load(vrow + s * stride_qkv_s, mask=vm, other=0.0).to(tl.float32)
        tl.store(vc_ptr + cell + vh[:, None] * s_head + dd[None, :], _to(v, vc_ptr), mask=vm)

    @triton.jit
    def _rope_heads(row_ptr, heads, hm, d, NP, stride_s, c, sn, like_ptr,
                    N: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr):
        """Heads `heads` ([N] indices, rows masked by hm) of one row of qkv partials (NP of them,
        stride_s apart), summed, then RoPE'd with the table rows c, sn ([1, HD] float32, the
        step's position): [N, HD] float32, rounded where _rope_kv_kernel rounds (the sum, each
        product, their sum)."""
        part = (d + HALF) % HD  # rotate-half partner: x[d + hd/2] for the first half, x[d - hd/2] after
        x = tl.zeros([N, HD], dtype=tl.float32)
        xp = tl.zeros([N, HD], dtype=tl.float32)
        base = row_ptr + heads[:, None] * HD
        for s in range(0, NP):
            x += tl.load(base + s * stride_s + d[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
            xp += tl.load(base + s * stride_s + part[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
        x = _round(x, like_ptr)
        xp = _round(xp, like_ptr)
        return _round(_round(x * c, like_ptr) + _round(xp * sn, like_ptr), like_ptr)

    @triton.jit
    def _step_inputs(b, pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_pos, stride_slot, stride_cos, d,
                     FUSE_ROPE: tl.constexpr):
        """Row b's position and slot, and with FUSE_ROPE the RoPE table rows at that position
        ([1, HD] float32; without it zeros, unused): the step's inputs and tables, which no
        kernel of the step writes."""
        pos = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
        slot = tl.load(slot_ptr + b * stride_slot)
        if FUSE_ROPE:
            c = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)[None, :]
            sn = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)[None, :]
        else:
            c = tl.zeros_like(d).to(tl.float32)[None, :]
            sn = c
        return pos, slot, c, sn

    @triton.jit
    def _kv_tile(base, s_seq, offs, valid, d, EV: tl.constexpr):
        """The cache rows `offs` ([BLOCK_S, HD]) of one (slot, kv head); zeros where not valid.
        EV: the loads' L2 eviction policy ("" default, or "evict_last")."""
        return tl.load(base + offs[:, None] * s_seq + d[None, :], mask=valid[:, None], other=0.0, eviction_policy=EV)

    @triton.jit
    def _scores(q, kt, valid, q_ptr, scale, IEEE: tl.constexpr):
        """Scores of the GP query rows against the keys of tile `kt` as the reference rounds
        them: q.k accumulated in float32 and rounded, times scale, rounded; -inf where not valid."""
        sc = _round(_round(_dot(q, tl.trans(kt), IEEE), q_ptr) * scale, q_ptr)
        return tl.where(valid[None, :], sc, float("-inf"))

    @triton.jit
    def _online_step(sc, vt, m_i, l_i, acc, like_ptr, IEEE: tl.constexpr):
        """Flash-decoding: fold a block of scores `sc` and values `vt` into (m, l, acc)."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(_to(p, like_ptr), vt, IEEE)
        return m_new, l_i, acc

    @triton.jit
    def _stats_step(sc, m_i, l_i):
        """Fold a block of scores into the running max and sum of exp(s - max)."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        return m_new, l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(sc - m_new[:, None]), axis=1)

    @triton.jit
    def _exact_step(sc, vt, m_i, l_i, acc, like_ptr, IEEE: tl.constexpr):
        """acc += p @ v with p = exp(s - M) / L rounded to the model dtype, as the reference."""
        p = tl.exp(sc - m_i[:, None]) / l_i[:, None]
        return acc + _dot(_to(p, like_ptr), vt, IEEE)

    @triton.jit
    def _attn_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr,
                     scale, stride_pos, stride_slot, s_slot, s_head, s_seq, pf_ptr, pf_lines,
                     qkv_ptr, cos_ptr, sin_ptr, NP, stride_qkv_s, stride_qkv_b, stride_cos,
                     H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                     NSPLIT: tl.constexpr, NS_P: tl.constexpr, BLOCK_S: tl.constexpr,
                     PHASE: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr, PF_LINE: tl.constexpr, PF_CHUNK: tl.constexpr,
                     FUSE_ROPE: tl.constexpr, WRITE_KV: tl.constexpr, PRELOAD_KV: tl.constexpr,
                     EARLY_INPUTS: tl.constexpr, KV_EV: tl.constexpr,
                     l2_ptr, l2_rows, l2_stride, l2_bytes, L2_AT: tl.constexpr, L2_CH: tl.constexpr,
                     sum_ptr, den_ptr, B_H, SUM: tl.constexpr):
        """Grid (B, KV, NSPLIT): the G query heads of kv head `kvh` of row b over one split
        of the keys 0..pos[b] of slot[b]; nothing past pos[b] is read. A split covers cdiv(pos+1, NSPLIT) keys rounded up to BLOCK_S; one
        that starts past pos runs no iteration (m = -inf, l = 0, acc = 0).

        PHASE 0, online softmax (flash-decoding): stores the unnormalised partial
          (acc, m, l); NSPLIT == 1 normalises and stores o directly.
        PHASE 1, statistics: stores the split's max m and sum l = sum exp(s - m).
        PHASE 2, the reference's rounding: p = exp(s - M) / L with the row's global M, L
          (from PHASE 1's partials, or with NSPLIT == 1 from a first loop here), rounded
          to the model dtype, then acc = sum p * v in float32; stores acc as a partial
          (NSPLIT > 1) or rounded into o. Reads K twice but rounds p where the reference
          does (softmax in float32, then cast), so it stays within ulps of it.
        Partials: po [B, H, NSPLIT, HD], pm / pl [B, H, NSPLIT], float32.
        Without FUSE_ROPE, q comes RoPE'd from q_ptr (_rope_kv_kernel wrote it and this step's
        K/V) and nothing is written to the cache. FUSE_ROPE: q is RoPE'd here from the qkv
        partials, and with WRITE_KV the split holding position pos[b] also writes this step's
        K/V cell (slot[b], kvh, pos[b]), the only cache write, then reads it back after a
        block barrier like any other key.
        PDL with PF_CHUNK > 0: before waiting, the programs share out the prefetch of pf_lines
        lines of PF_LINE elements at pf_ptr (o_proj's weight, read by the kernel after next).
        PRELOAD_KV: the split's first block of K (and V) is loaded before the wait (cells of
        earlier steps: no kernel of this step writes them), its row at pos[b] taken after it
        from the values this program writes (WRITE_KV), else re-read from the cache.
        EARLY_INPUTS (or PRELOAD_KV): pos[b], slot[b] and, with FUSE_ROPE, the RoPE table rows
        at pos[b] are loaded before the wait (the step's inputs and tables: nothing writes them).
        KV_EV: the K/V loads' L2 eviction policy ("" default, or "evict_last").
        L2_AT 1 (at entry) or 2 (after the wait): the programs share out a bulk L2 prefetch of
        l2_bytes at l2_ptr + r * l2_stride for r < l2_rows (a later kernel's weight rows).
        SUM (PHASE 0, NSPLIT > 1; KNOBS["combine"]["IN_O"]): the split also adds acc * f into
        sum_ptr [B, H, HD] and l * f into den_ptr [B, H] (float32, zeros before; atomics),
        f = exp(m - M) for each head's M = the larger of the scores of this step's key and of
        key 0 (this step's key alone at position 0), the same in every split of the head, so
        sum / den is the head's attention output whatever the splits' order. The split holding
        M's key scores it within a rounding of M, so den is about 1 or more; a split whose m
        is above M by more than 60 sets den_ptr[B_H] (B_H = B * H; zero before) to 1.
        """
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        _pdl_enter(PDL)
        l2_pid = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + sp
        l2_nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        if L2_AT == 1:
            _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)
        d = tl.arange(0, HD)
        if PRELOAD_KV or EARLY_INPUTS:  # the step's inputs and tables: before the wait
            pos, slot, c, sn = _step_inputs(b, pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_pos, stride_slot,
                                            stride_cos, d, FUSE_ROPE)
        if PDL:
            if PF_CHUNK > 0:
                nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
                pid = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + sp
                per = tl.cdiv(pf_lines, nprog)
                for j0 in range(0, per, PF_CHUNK):
                    idx = tl.minimum(pid * per + j0 + tl.arange(0, PF_CHUNK), pf_lines - 1)
                    _prefetch(pf_ptr + idx.to(tl.int64) * PF_LINE)
        if not PRELOAD_KV:
            _pdl_wait(PDL)
            if L2_AT == 2:
                _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)
            if not EARLY_INPUTS:
                pos, slot, c, sn = _step_inputs(b, pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_pos, stride_slot,
                                                stride_cos, d, FUSE_ROPE)
        n = pos + 1
        per = (n + NSPLIT - 1) // NSPLIT
        chunk = (per + BLOCK_S - 1) // BLOCK_S * BLOCK_S
        start = sp * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, GP)
        gm = g < G
        heads = kvh * G + g
        base = slot.to(tl.int64) * s_slot + kvh * s_head
        k_base = kc_ptr + base
        v_base = vc_ptr + base
        if SUM:  # key 0 (an earlier step's cell once pos > 0), loaded beside the step's first loads
            k_first = tl.load(k_base + d).to(tl.float32)
        if PRELOAD_KV:
            offs0 = start + tl.arange(0, BLOCK_S)
            valid0 = offs0 < end
            kt0 = _kv_tile(k_base, s_seq, offs0, valid0, d, KV_EV)
            if PHASE != 1:
                vt0 = _kv_tile(v_base, s_seq, offs0, valid0, d, KV_EV)
            _pdl_wait(PDL)
            if L2_AT == 2:
                _prefetch_rows(l2_ptr, l2_rows, l2_stride, l2_bytes, l2_pid, l2_nprog, L2_CH)
        if FUSE_ROPE:
            qrow = qkv_ptr + b * stride_qkv_b
            q = _to(_rope_heads(qrow, heads, gm, d, NP, stride_qkv_s, c, sn, kc_ptr, GP, HD, HD // 2), q_ptr)
            if WRITE_KV:
                one = g == 0  # row 0 of [GP, HD] tiles carries this kv head's k / v
                k = _rope_heads(qrow, H + kvh + 0 * g, one, d, NP, stride_qkv_s, c, sn, kc_ptr, GP, HD, HD // 2)
                v = tl.zeros([GP, HD], dtype=tl.float32)
                vrow = qrow + (H + H // G + kvh) * HD + d[None, :] + 0 * g[:, None]
                for s in range(0, NP):
                    v += tl.load(vrow + s * stride_qkv_s, mask=one[:, None], other=0.0).to(tl.float32)
                cell = pos.to(tl.int64) * s_seq + 0 * g[:, None] + d[None, :]
                # the split holding position pos writes it
                at = pos + 0 * d[None, :]  # full-shape compares: the interpreter rejects scalar masks
                wm = one[:, None] & (at >= start) & (at < end)
                tl.store(k_base + cell, _to(k, kc_ptr), mask=wm)
                tl.store(v_base + cell, _to(v, vc_ptr), mask=wm)
                tl.debug_barrier()  # the block's own cache writes, visible to its loads below
        else:
            q = tl.load(q_ptr + b * (H * HD) + heads[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0)
        if PRELOAD_KV:  # this step's row: from this program's registers, or re-read now it is written
            at0 = (offs0 == pos)[:, None]
            if FUSE_ROPE and WRITE_KV:
                kt0 = tl.where(at0, _to(tl.sum(tl.where(one[:, None], k, 0.0), axis=0), kc_ptr)[None, :], kt0)
                if PHASE != 1:
                    vt0 = tl.where(at0, _to(tl.sum(tl.where(one[:, None], v, 0.0), axis=0), vc_ptr)[None, :], vt0)
            else:
                kt0 = tl.where(at0, tl.load(k_base + pos.to(tl.int64) * s_seq + d)[None, :], kt0)
                if PHASE != 1:
                    vt0 = tl.where(at0, tl.load(v_base + pos.to(tl.int64) * s_seq + d)[None, :], vt0)
            lo = start + BLOCK_S  # the loops below start after the preloaded block
        else:
            lo = start
        row = (b * H + heads) * NSPLIT + sp
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, HD], dtype=tl.float32)
        if PHASE == 0:
            if PRELOAD_KV:
                if start < end:
                    m_i, l_i, acc = _online_step(_scores(q, kt0, valid0, q_ptr, scale, IEEE), vt0, m_i, l_i, acc,
                                                 vc_ptr, IEEE)
            for s0 in range(lo, end, BLOCK_S):
                offs = s0 + tl.arange(0, BLOCK_S)
                valid = offs < end
                sc = _scores(q, _kv_tile(k_base, s_seq, offs, valid, d, KV_EV), valid, q_ptr, scale, IEEE)
                m_i, l_i, acc = _online_step(sc, _kv_tile(v_base, s_seq, offs, valid, d, KV_EV), m_i, l_i, acc,
                                             vc_ptr, IEEE)
            if NSPLIT == 1:
                tl.store(o_ptr + b * (H * HD) + heads[:, None] * HD + d[None, :],
                         _to(acc / l_i[:, None], o_ptr), mask=gm[:, None])
            else:
                tl.store(po_ptr + row[:, None] * HD + d[None, :], acc, mask=gm[:, None])
                tl.store(pm_ptr + row, m_i, mask=gm)
                tl.store(pl_ptr + row, l_i, mask=gm)
                if SUM:  # into the head's sum and denominator, on the heads' common M
                    if FUSE_ROPE and WRITE_KV:  # this step's key, rounded as the cache holds it
                        k_now = _round(tl.sum(tl.where(one[:, None], k, 0.0), axis=0), kc_ptr)
                    else:
                        k_now = tl.load(k_base + pos.to(tl.int64) * s_seq + d).to(tl.float32)
                    qf = q.to(tl.float32)
                    s_now = tl.sum(qf * k_now[None, :], axis=1) * scale
                    s_first = tl.sum(qf * k_first[None, :], axis=1) * scale
                    at = pos + 0 * g  # full-shape compares: the interpreter rejects scalar masks
                    ref = tl.where(at > 0, tl.maximum(s_now, s_first), s_now)
                    f = tl.where(gm, tl.exp(m_i - ref), 0.0)  # a split without keys: m = -inf, 0
                    hrow = b * H + heads
                    tl.atomic_add(sum_ptr + hrow[:, None] * HD + d[None, :], acc * f[:, None], mask=gm[:, None],
                                  sem="relaxed")
                    tl.atomic_add(den_ptr + hrow, l_i * f, mask=gm, sem="relaxed")
                    # a weight past exp(60): flag den_ptr[B * H] (o_proj merges the partials)
                    tl.store(den_ptr + B_H + 0 * g, tl.full([GP], 1.0, tl.float32), mask=gm & (m_i - ref > 60.0))
        else:
            if PHASE == 1 or NSPLIT == 1:  # NSPLIT == 1: start is 0
                if PRELOAD_KV:
                    if start < end:
                        m_i, l_i = _stats_step(_scores(q, kt0, valid0, q_ptr, scale, IEEE), m_i, l_i)
                for s0 in range(lo, end, BLOCK_S):
                    offs = s0 + tl.arange(0, BLOCK_S)
                    valid = offs < end
                    sc = _scores(q, _kv_tile(k_base, s_seq, offs, valid, d, KV_EV), valid, q_ptr, scale, IEEE)
                    m_i, l_i = _stats_step(sc, m_i, l_i)
            if PHASE == 1:
                tl.store(pm_ptr + row, m_i, mask=gm)
                tl.store(pl_ptr + row, l_i, mask=gm)
            else:
                if NSPLIT > 1:  # the row's global max and sum from the splits' statistics
                    ss = tl.arange(0, NS_P)
                    srow = ((b * H + heads) * NSPLIT)[:, None] + ss[None, :]
                    sm = gm[:, None] & (ss < NSPLIT)[None, :]
                    ms = tl.load(pm_ptr + srow, mask=sm, other=float("-inf"))
                    ls = tl.load(pl_ptr + srow, mask=sm, other=0.0)
                    m_i = tl.where(gm, tl.max(ms, axis=1), 0.0)
                    l_i = tl.sum(tl.where(sm, ls * tl.exp(ms - m_i[:, None]), 0.0), axis=1)
                m_i = tl.where(gm, m_i, 0.0)  # padding query rows: no inf - inf
                l_i = tl.where(gm, l_i, 1.0)
                if PRELOAD_KV:
                    if start < end:
                        acc = _exact_step(_scores(q, kt0, valid0, q_ptr, scale, IEEE), vt0, m_i, l_i, acc,
                                          vc_ptr, IEEE)
                for s0 in range(lo, end, BLOCK_S):
                    offs = s0 + tl.arange(0, BLOCK_S)
                    valid = offs < end
                    sc = _scores(q, _kv_tile(k_base, s_seq, offs, valid, d, KV_EV), valid, q_ptr, scale, IEEE)
                    acc = _exact_step(sc, _kv_tile(v_base, s_seq, offs, valid, d, KV_EV), m_i, l_i, acc, vc_ptr, IEEE)
                if NSPLIT == 1:
                    tl.store(o_ptr + b * (H * HD) + heads[:, None] * HD + d[None, :],
                             _to(acc, o_ptr), mask=gm[:, None])
                else:
                    tl.store(po_ptr + row[:, None] * HD + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def _attn_combine_kernel(o_ptr, po_ptr, pm_ptr, pl_ptr,
                             HD: tl.constexpr, NSPLIT: tl.constexpr, NS_P: tl.constexpr,
                             WEIGHTED: tl.constexpr, PDL: tl.constexpr):
        """Grid (B * H,): merge the NSPLIT partials of one (row, head) into o (model dtype).
        WEIGHTED (online softmax): sum acc_s * exp(m_s - M) / sum l_s * exp(m_s - M);
        else the partials are already normalised: a plain sum."""
        _pdl_enter(PDL)
        _pdl_wait(PDL)
        bh = tl.program_id(0)
        s = tl.arange(0, NS_P)
        sm = s < NSPLIT
        d = tl.arange(0, HD)
        acc = tl.load(po_ptr + (bh * NSPLIT + s)[:, None] * HD + d[None, :], mask=sm[:, None], other=0.0)
        if WEIGHTED:
            m = tl.load(pm_ptr + bh * NSPLIT + s, mask=sm, other=float("-inf"))
            l = tl.load(pl_ptr + bh * NSPLIT + s, mask=sm, other=0.0)
            mx = tl.max(m, axis=0)
            wgt = tl.where(sm, tl.exp(m - mx), 0.0)
            out = tl.sum(acc * wgt[:, None], axis=0) / tl.sum(l * wgt, axis=0)
        else:
            out = tl.sum(acc, axis=0)
        tl.store(o_ptr + bh * HD + d, _to(out, o_ptr))


if HAVE_GLUON:

    @gluon.jit
    def _gl_gdc(WAIT: gl.constexpr):
        """griddepcontrol.wait (WAIT) or .launch_dependents."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _gl_pdl_enter(PDL: gl.constexpr):
        """_pdl_enter for Gluon kernels: PDL == 2 lets the next kernel launch now."""
        if PDL == 2:
            _gl_gdc(False)

    @gluon.jit
    def _gl_pdl_wait(PDL: gl.constexpr):
        """_pdl_wait for Gluon kernels: with PDL, wait for the kernel before this one; PDL == 1
        then lets the next one launch."""
        if PDL:
            _gl_gdc(True)
            if PDL == 1:
                _gl_gdc(False)

    @gluon.jit
    def _gemv_smem_kernel(x_ptr, w_ptr, out_ptr, g_ptr, eps, N, stride_wn, K: gl.constexpr,
                          BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NW: gl.constexpr, PDL: gl.constexpr,
                          EVW: gl.constexpr, TMA: gl.constexpr, w_desc):
        """out[n] = (rms_norm(x) * g) . w[n] for B == 1 (x: the float32 residual, K columns, a
        multiple of BLOCK_K; the FOLD GEMV of _gemv_kernel), one program per BLOCK_N rows.

        Before its PDL wait the program copies its rows of w whole into shared memory
        (cp.async, 16 bytes a thread a copy; EVW the L2 eviction policy; TMA: bulk tensor
        copies of w_desc's [BLOCK_N, BLOCK_K] boxes, one mbarrier counting their bytes): weights
        only, which no kernel writes. After it the program loads all of x at once (g before the
        wait), sums its squares and puts x * g in shared memory; each of K / BLOCK_K steps then
        adds the rows' products of two shared tiles (no global load in the loop, which Gluon
        does not pipeline); the output is scaled by rsqrt(sum / K + eps) and stored in out's
        dtype. PDL 1: the next kernel may launch after the wait; 2: at entry. NW: the launch's
        num_warps (the layouts' warps)."""
        L: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [NW, 1], [1, 0])
        S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        STEPS: gl.constexpr = K // BLOCK_K
        pid = gl.program_id(0)
        rows = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, L))
        nm = rows < N
        _gl_pdl_enter(PDL)
        if TMA:
            smem = gl.allocate_shared_memory(w_desc.dtype, [STEPS, BLOCK_N, BLOCK_K], w_desc.layout)
            bar = gl.allocate_shared_memory(gl.int64, [1], _gl_mb.MBarrierLayout())
            _gl_mb.init(bar, count=1)
            _gl_mb.expect(bar, STEPS * w_desc.block_type.nbytes)
            for j in gl.static_range(STEPS):
                _gl_tma_load(w_desc, [pid * BLOCK_N, j * BLOCK_K], bar, smem.index(j))
        else:
            smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STEPS, BLOCK_N, BLOCK_K], S)
            m2 = nm[:, None] & (cols < BLOCK_K)[None, :]
            ptrs = w_ptr + rows.to(gl.int64)[:, None] * stride_wn + cols[None, :]
            for j in gl.static_range(STEPS):
                _gl_copy(smem.index(j), ptrs + j * BLOCK_K, mask=m2, eviction_policy=EVW)
            _gl_cp.commit_group()
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, NW], [1, 0])
        xo = (gl.arange(0, STEPS, layout=gl.SliceLayout(1, XL))[:, None] * BLOCK_K
              + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))[None, :])
        ga = gl.load(g_ptr + xo).to(gl.float32)  # [STEPS, BLOCK_K]: the norm weight, before the wait
        _gl_pdl_wait(PDL)
        xa = gl.load(x_ptr + xo)
        sq = gl.sum(gl.sum(xa * xa, axis=1), axis=0)
        xs = gl.allocate_shared_memory(gl.float32, [STEPS, BLOCK_K], S, value=xa * ga)
        acc = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, L))
        if TMA:
            _gl_mb.wait(bar, 0)
        else:
            _gl_cp.wait_group(0)  # this thread's copies
        _gl_barrier()  # every thread's copies and x * g, visible to all
        for j in gl.static_range(STEPS):
            w = smem.index(j).load(L).to(gl.float32)
            acc += gl.sum(w * xs.slice(j, 1).load(L), axis=1)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
        r = 1.0 / gl.sqrt(sq / K + eps)
        gl.store(out_ptr + rows, (acc * r).to(out_ptr.dtype.element_ty), mask=nm)

    @gluon.jit
    def _gl_ld_acquire(ptr):
        """ld.acquire.gpu of the int32 at ptr."""
        return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _ogu_fill(wgu_desc, bars, g_s, u_s, row, I, k, cur, SUB: gl.constexpr, BK: gl.constexpr):
        """Stage `cur` of the ring: SUB consecutive [BN, BK] boxes of gate and of up rows `row`..
        from column k * SUB * BK (one mbarrier counting their bytes)."""
        _gl_mb.expect(bars.index(cur), 2 * SUB * wgu_desc.block_type.nbytes)
        for j in gl.static_range(SUB):
            _gl_tma_load(wgu_desc, [row, (k * SUB + j) * BK], bars.index(cur), g_s.index(cur * SUB + j))
            _gl_tma_load(wgu_desc, [I + row, (k * SUB + j) * BK], bars.index(cur), u_s.index(cur * SUB + j))

    @gluon.jit
    def _o_gate_up_kernel(a_ptr, x_ptr, g_ptr, act_ptr, bar_ptr, eps, D, I, wo_desc, wgu_desc,
                          K: gl.constexpr, KO: gl.constexpr, BO: gl.constexpr, BN: gl.constexpr,
                          BK: gl.constexpr, SUB: gl.constexpr, STAGES: gl.constexpr, EARLY: gl.constexpr,
                          NPROG: gl.constexpr, NW: gl.constexpr, PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr):
        """o_proj and gate_up of one layer for B == 1 (KNOBS["o_gate_up"]): x[D] += wo . a, then
        act[n] = silu(gate_n) * up_n of rms_norm(x) * g (FOLD's GEMV: x the float32 residual,
        K == D columns); a: the attention's output (KO columns). NPROG programs, all resident
        at once; program p owns o's rows p * BO.. (masked past D) and gate_up's rows p * BN..
        (gate) and I + p * BN.. (up).

        Before its PDL wait each program copies its o rows whole, and the first EARLY stages
        of a ring of STAGES (each SUB consecutive [BN, BK] boxes of its gate and up rows: runs
        of SUB * BK columns a row), into shared memory with bulk tensor copies (weights, which
        no kernel writes), so they stream while the kernels before it (the attention and its
        combine) leave the memory idle; the ring's other stages follow the wait. After it the
        program adds its o rows into x (each row one program's: no atomics), meets every other
        program at a grid barrier (a zeroed counter at bar_ptr, one per call; a spin past
        SPIN_LIMIT polls gives up: wrong results, never a hang), stages x * g, and sums
        gate_up's stages as they land, each refilled STAGES stages ahead once used. Roundings
        as _gemv_kernel's SILU epilogue (gate, up, silu(gate), product). PDL 1: the next
        kernel may launch after the wait; 2: at entry."""
        L: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [NW, 1], [1, 0])
        V: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, NW], [1, 0])  # a step's [1, BK] of a vector
        S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # vectors as [steps, 1, BK]: a step each
        STEPS: gl.constexpr = K // (SUB * BK)  # the ring's stages of gate_up, in all
        OSTEPS: gl.constexpr = KO // BK
        pid = gl.program_id(0)
        _gl_pdl_enter(PDL)
        o_s = gl.allocate_shared_memory(wo_desc.dtype, [OSTEPS, BO, BK], wo_desc.layout)
        g_s = gl.allocate_shared_memory(wgu_desc.dtype, [STAGES * SUB, BN, BK], wgu_desc.layout)
        u_s = gl.allocate_shared_memory(wgu_desc.dtype, [STAGES * SUB, BN, BK], wgu_desc.layout)
        o_bar = gl.allocate_shared_memory(gl.int64, [1], _gl_mb.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], _gl_mb.MBarrierLayout())
        _gl_mb.init(o_bar, count=1)
        for st in gl.static_range(STAGES):
            _gl_mb.init(bars.index(st), count=1)
        _gl_fence()
        _gl_mb.expect(o_bar, OSTEPS * wo_desc.block_type.nbytes)
        for j in gl.static_range(OSTEPS):
            _gl_tma_load(wo_desc, [pid * BO, j * BK], o_bar, o_s.index(j))
        for st in gl.static_range(EARLY):
            _ogu_fill(wgu_desc, bars, g_s, u_s, pid * BN, I, st, st, SUB, BK)
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, V))[None, :]
        gn = gl.allocate_shared_memory(gl.float32, [K // BK, 1, BK], S)
        for j in gl.static_range(K // BK):  # the norm weight, before the wait: no kernel writes it
            gn.index(j).store(gl.load(g_ptr + j * BK + cols).to(gl.float32))
        _gl_pdl_wait(PDL)
        for st in gl.static_range(EARLY, STAGES):
            _ogu_fill(wgu_desc, bars, g_s, u_s, pid * BN, I, st, st, SUB, BK)
        a_s = gl.allocate_shared_memory(gl.float32, [OSTEPS, 1, BK], S)
        for j in gl.static_range(OSTEPS):
            a_s.index(j).store(gl.load(a_ptr + j * BK + cols).to(gl.float32))
        rows_o = pid * BO + gl.arange(0, BO, layout=gl.SliceLayout(1, L))
        acc_o = gl.zeros([BO, BK], gl.float32, layout=L)  # products summed along K once, at the end
        _gl_mb.wait(o_bar, 0)
        _gl_barrier()  # a in shared memory, seen by every thread
        for j in range(OSTEPS):
            acc_o += o_s.index(j).load(L).to(gl.float32) * a_s.index(j).load(L)
        acc_o = gl.sum(acc_o, axis=1)
        om = rows_o < D
        gl.store(x_ptr + rows_o, gl.load(x_ptr + rows_o, mask=om, other=0.0) + acc_o, mask=om)
        _gl_barrier()  # the program's stores before its arrival
        gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        seen = _gl_ld_acquire(bar_ptr)
        spins = 0
        while (seen < NPROG) & (spins < SPIN_LIMIT):
            seen = _gl_ld_acquire(bar_ptr)
            spins += 1
        _gl_barrier()
        xs = gl.allocate_shared_memory(gl.float32, [K // BK, 1, BK], S)
        sq = gl.zeros([1, BK], gl.float32, layout=V)
        for j in gl.static_range(K // BK):  # x whole (other programs' rows: from L2), x * g staged
            xj = gl.load(x_ptr + j * BK + cols, cache_modifier=".cg")
            sq += xj * xj
            xs.index(j).store(xj * gn.index(j).load(V))
        sq = gl.sum(gl.sum(sq, axis=1), axis=0)
        _gl_barrier()
        acc_g = gl.zeros([BN, BK], gl.float32, layout=L)
        acc_u = gl.zeros([BN, BK], gl.float32, layout=L)
        for k in range(STEPS):
            cur = k % STAGES
            _gl_mb.wait(bars.index(cur), (k // STAGES) % 2)
            for j in gl.static_range(SUB):
                xk = xs.index(k * SUB + j).load(L)  # [1, BK]
                acc_g += g_s.index(cur * SUB + j).load(L).to(gl.float32) * xk
                acc_u += u_s.index(cur * SUB + j).load(L).to(gl.float32) * xk
            if k + STAGES < STEPS:  # the stage, read by every thread, refilled STAGES stages ahead
                _gl_barrier()
                _gl_fence()
                _ogu_fill(wgu_desc, bars, g_s, u_s, pid * BN, I, k + STAGES, cur, SUB, BK)
        r = 1.0 / gl.sqrt(sq / K + eps)
        gv = (gl.sum(acc_g, axis=1) * r).to(act_ptr.dtype.element_ty).to(gl.float32)
        uv = (gl.sum(acc_u, axis=1) * r).to(act_ptr.dtype.element_ty).to(gl.float32)
        sv = (gv / (1.0 + gl.exp(-gv))).to(act_ptr.dtype.element_ty).to(gl.float32)
        rows_g = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
        gl.store(act_ptr + rows_g, (sv * uv).to(act_ptr.dtype.element_ty), mask=rows_g < I)

    @gluon.jit
    def _gl_st(ptrs, vals, mask, BITS: gl.constexpr):
        """st.global of `vals` (BITS 32: float32, 16: bf16 / fp16) at `ptrs` where `mask`, by every
        CTA of a cluster (Gluon predicates its own stores of a cluster-replicated layout to CTA 0)."""
        if BITS == 32:
            gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.global.b32 [$1], $2; "
                                      "mov.u32 $0, 0; }", "=r,l,r,r",
                                      [ptrs, vals.to(gl.int32, bitcast=True), mask.to(gl.int32)],
                                      dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.global.b16 [$1], $2; "
                                      "mov.u32 $0, 0; }", "=r,l,h,r",
                                      [ptrs, vals.to(gl.int16, bitcast=True), mask.to(gl.int32)],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gl_cluster_rank():
        """This CTA's rank in its cluster."""
        return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _gl_cluster_sync():
        """Every CTA of the cluster: its writes before (release) seen by all after (acquire)."""
        gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                                  "// $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gl_bf(x):
        """float32 rounded to bfloat16 and back (the reference's rounding points; bf16 models)."""
        return x.to(gl.bfloat16).to(gl.float32)

    @gluon.jit
    def _gl_rope_rows(base, NP, stride_s, rows, d, c, sn, HD: gl.constexpr):
        """Rows at base + rows ([N, 1] offsets of heads) of NP qkv partials summed (columns d,
        [1, HD]), then RoPE'd with the table rows c, sn ([N, HD] float32, the result's layout),
        rounded where _rope_heads rounds: float32 holding bf16 values."""
        part = (d + HD // 2) % HD  # rotate-half partner
        x = c * 0.0
        xp = c * 0.0
        for s in range(0, NP):
            x += gl.load(base + s * stride_s + rows + d).to(gl.float32)
            xp += gl.load(base + s * stride_s + rows + part).to(gl.float32)
        x = _gl_bf(x)
        xp = _gl_bf(xp)
        return _gl_bf(_gl_bf(x * c) + _gl_bf(xp * sn))

    @gluon.jit
    def _attn_cluster_kernel(qkv_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, o_ptr,
                             po_ptr, pm_ptr, pl_ptr, scale, NP, stride_qkv_s, stride_cos,
                             s_slot, s_head, s_seq,
                             H: gl.constexpr, G: gl.constexpr, HD: gl.constexpr, NC: gl.constexpr,
                             BS: gl.constexpr, L3: gl.constexpr, LQ: gl.constexpr, LC: gl.constexpr,
                             PDL: gl.constexpr, KV_EV: gl.constexpr):
        """Batch 1, bf16: kv head `kvh` (the cluster's index) of this step's attention with online
        softmax, as _attn_kernel's PHASE 0 with FUSE_ROPE, WRITE_KV and EARLY_INPUTS, and its
        combine, in one launch: a cluster of NC CTAs, CTA `rank` one split of the keys 0..pos.
        Each CTA RoPEs the G query rows and this step's k, sums v, and the split holding pos
        writes its cache cell; it scores its keys (float32 products of bf16 values, rounded as
        _scores rounds), stores its partial (po [H, NC, HD], pm / pl [H, NC], float32), and
        after a cluster barrier (release / acquire) merges HD * G / NC of the head group's
        outputs from every split's partial, as _attn_combine_kernel does, into o (bf16).
        Layouts (constexpr, each replicated over the cluster's CTAs): L3 [G, BS, HD] for the
        products, LQ [G, HD] for stores, LC [NC, HD * G / NC] for the merge. Its stores are
        inline PTX (Gluon would let only CTA 0 store a replicated layout)."""
        kvh = gl.program_id(0)  # the cluster
        rank = _gl_cluster_rank()
        _gl_pdl_enter(PDL)
        LK: gl.constexpr = gl.SliceLayout(0, L3)  # [BS, HD]
        LG: gl.constexpr = gl.SliceLayout(1, L3)  # [G, HD]
        LS: gl.constexpr = gl.SliceLayout(2, L3)  # [G, BS]
        s_k = gl.arange(0, BS, layout=gl.SliceLayout(1, LK))[:, None]
        d_k = gl.arange(0, HD, layout=gl.SliceLayout(0, LK))[None, :]
        g_s = gl.arange(0, G, layout=gl.SliceLayout(1, LQ))[:, None]  # [G, HD] tiles, one element a thread
        d_s = gl.arange(0, HD, layout=gl.SliceLayout(0, LQ))[None, :]
        pos = gl.load(pos_ptr).to(gl.int32)  # the step's inputs and tables: before the wait
        slot = gl.load(slot_ptr).to(gl.int64)
        ds2 = d_s + 0 * g_s
        c_s = gl.load(cos_ptr + pos * stride_cos + ds2).to(gl.float32)
        sn_s = gl.load(sin_ptr + pos * stride_cos + ds2).to(gl.float32)
        _gl_pdl_wait(PDL)
        q = gl.convert_layout(_gl_rope_rows(qkv_ptr + (kvh * G) * HD, NP, stride_qkv_s, g_s * HD, d_s, c_s, sn_s,
                                            HD), LG)
        n = pos + 1
        per = (n + NC - 1) // NC
        chunk = (per + BS - 1) // BS * BS
        start = rank * chunk
        end = gl.minimum(start + chunk, n)
        base = slot * s_slot + kvh * s_head
        # this step's k and v (row 0 of [G, HD] tiles), written by the split holding pos
        one = (g_s == 0) & (ds2 >= 0)
        k = _gl_rope_rows(qkv_ptr + (H + kvh) * HD, NP, stride_qkv_s, 0 * g_s, d_s, c_s, sn_s, HD)
        v = c_s * 0.0
        for s in range(0, NP):
            v += gl.load(qkv_ptr + s * stride_qkv_s + (H + H // G + kvh) * HD + ds2).to(gl.float32)
        cell = base + pos.to(gl.int64) * s_seq + ds2
        wm = one & (pos >= start) & (pos < end)
        _gl_st(kc_ptr + cell, k.to(gl.bfloat16), wm, 16)
        _gl_st(vc_ptr + cell, v.to(gl.bfloat16), wm, 16)
        _gl_barrier()  # the CTA's own cache writes, visible to its loads below
        m_i = gl.full([G], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LS))
        l_i = gl.zeros([G], gl.float32, layout=gl.SliceLayout(1, LS))
        acc = gl.zeros([G, HD], gl.float32, layout=LG)
        q3 = q[:, None, :]
        for s0 in range(start, end, BS):
            offs = s0 + s_k
            valid = (offs < end) & (d_k >= 0)
            kt = gl.load(kc_ptr + base + offs.to(gl.int64) * s_seq + d_k, mask=valid, other=0.0,
                         eviction_policy=KV_EV).to(gl.float32)
            vt = gl.load(vc_ptr + base + offs.to(gl.int64) * s_seq + d_k, mask=valid, other=0.0,
                         eviction_policy=KV_EV).to(gl.float32)
            sc = _gl_bf(_gl_bf(gl.sum(q3 * kt[None, :, :], axis=2)) * scale)  # [G, BS]
            cols = s0 + gl.arange(0, BS, layout=gl.SliceLayout(0, LS))[None, :]
            sc = gl.where(cols < end, sc, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=1))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            pv = gl.sum(_gl_bf(p)[:, :, None] * vt[None, :, :], axis=1)  # [G, HD]
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, LG))[:, None] + pv
            m_i = m_new
        # the split's partial
        row = (kvh * G + g_s) * NC + rank
        _gl_st(po_ptr + row * HD + d_s, gl.convert_layout(acc, LQ), (g_s >= 0) & (d_s >= 0), 32)
        mq = gl.convert_layout(m_i, gl.SliceLayout(1, LQ))[:, None] + 0.0 * d_s
        lq = gl.convert_layout(l_i, gl.SliceLayout(1, LQ))[:, None] + 0.0 * d_s
        _gl_st(pm_ptr + row + 0 * d_s, mq, d_s == 0, 32)
        _gl_st(pl_ptr + row + 0 * d_s, lq, d_s == 0, 32)
        _gl_cluster_sync()
        # the merge: this CTA's OUT outputs of the head group (head hh, columns c0..)
        OUT: gl.constexpr = G * HD // NC
        hh = kvh * G + (rank * OUT) // HD
        c0 = (rank * OUT) % HD
        sp = gl.arange(0, NC, layout=gl.SliceLayout(1, LC))[:, None]
        dc = gl.arange(0, OUT, layout=gl.SliceLayout(0, LC))[None, :]
        pa = gl.load(po_ptr + (hh * NC + sp) * HD + c0 + dc, cache_modifier=".cg")
        pm = gl.load(pm_ptr + hh * NC + sp + 0 * dc, cache_modifier=".cg")
        pl = gl.load(pl_ptr + hh * NC + sp + 0 * dc, cache_modifier=".cg")
        mx = gl.max(pm, axis=0)[None, :]
        wgt = gl.exp(pm - mx)
        out = gl.sum(pa * wgt, axis=0) / gl.sum(pl * wgt, axis=0)
        _gl_st(o_ptr + hh * HD + c0 + dc, out[None, :].to(gl.bfloat16), dc >= 0, 16)


# ---- launchers -------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _pow2_floor(n: int) -> int:
    """The largest power of two <= n, or 0."""
    return 1 << (int(n).bit_length() - 1) if n > 0 else 0


def _stage(name: str) -> bool:
    return bool(KNOBS["stages"].get(name, True))


def _pdl_capable(dev: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer, not the interpreter."""
    return dev.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(dev)[0] >= 9


def _pdl(dev: torch.device) -> int:
    """Programmatic dependent launch for this step (KNOBS["pdl"] on, a capable device): 0 off,
    1 each kernel lets the next one launch after its wait, 2 at its entry (EARLY_TRIGGER)."""
    if not KNOBS["pdl"]["enabled"] or not _pdl_capable(dev):
        return 0
    return 2 if KNOBS["pdl"].get("EARLY_TRIGGER", False) else 1


def _early(pdl: int, group: str) -> int:
    """The PDL mode of a kernel of `group`: 2 (trigger at entry) with its EARLY_TRIGGER knob."""
    return 2 if pdl and KNOBS[group].get("EARLY_TRIGGER", False) else pdl


def _launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def _line(t: torch.Tensor) -> int:
    """Elements of `t` in a 128-byte cache line."""
    return max(1, 128 // t.element_size())


def _l2_prefetch(kernel: str, pdl: int, w_gu, other, num_warps: int) -> dict:
    """The bulk L2 prefetch arguments of `kernel`'s launch ("qkv", "attn" or "o"; num_warps
    its warps): with PDL and KNOBS["l2"]["GATE_UP_STEPS"] > 0, where KNOBS["l2"]["BY"] names
    this kernel, the K steps of every row of the layer's gate_up weight `w_gu` [2N, K] that
    follow gate_up's PRE; else none (L2_AT 0, `other`, any tensor, as the unused pointer)."""
    l2, kn = KNOBS["l2"], KNOBS["gate_up"]
    steps = int(l2.get("GATE_UP_STEPS", 0))
    by, at = l2.get("BY", "attn"), l2.get("AT", "wait")
    if steps > 0 and (by not in ("qkv", "attn", "o") or at not in ("entry", "wait")):
        raise ValueError(f'KNOBS["l2"]: BY {by!r} is not "qkv", "attn" or "o", or AT {at!r} not "entry" or "wait"')
    none = dict(l2_ptr=other, l2_rows=0, l2_stride=0, l2_bytes=0, L2_AT=0, L2_CH=1)
    if not pdl or w_gu is None or steps <= 0 or by != kernel:
        return none
    K, es, bk = w_gu.shape[1], w_gu.element_size(), int(kn["BLOCK_K"])
    pre = _pow2_floor(min(int(kn.get("PRE", 0)), triton.cdiv(K, bk))) * bk
    nbytes = (min(K, pre + steps * bk) - pre) * es
    if nbytes <= 0 or nbytes % 16 or (pre * es) % 16 or w_gu.stride(0) * es % 16 or w_gu.data_ptr() % 16:
        return none
    return dict(l2_ptr=w_gu[:, pre:], l2_rows=w_gu.shape[0], l2_stride=w_gu.stride(0) * es, l2_bytes=nbytes,
                L2_AT=_L2_AT[at], L2_CH=32 * int(num_warps))


_L2_AT = {"entry": 1, "wait": 2}  # KNOBS["l2"]["AT"] -> the kernels' L2_AT


def _l2_whole(pdl: int, nxt, num_warps: int, at: int = 3) -> dict:
    """The bulk L2 prefetch arguments of a kernel that pulls all of `nxt` (a later GEMV's
    weight, whole rows) into L2 at L2_AT `at` (1 entry, 2 after the wait, 3 its programs' end);
    none without PDL or nxt."""
    es = nxt.element_size() if nxt is not None else 0
    if not pdl or nxt is None or not nxt.is_contiguous() or nxt.stride(0) * es % 16 or nxt.data_ptr() % 16:
        return {}
    return dict(l2_ptr=nxt, l2_rows=nxt.shape[0], l2_stride=nxt.stride(0) * es,
                l2_bytes=nxt.shape[1] * es, L2_AT=at, L2_CH=32 * int(num_warps))


def _gemv(x, w, knob: str, out_dtype=None, silu: bool = False, pdl: bool = False, norm=None, into=None,
          w_gu=None, l2_next=None, down=None, zero=None, rope=None, heads=None):
    """x [B, K] @ w[:N]^T (w: [N, K] or, with silu, [2N, K] = [gate; up]).

    Returns float32 partials [SPLIT_K, B, N] (summed by the consumer), or with SPLIT_K == 1
    and out_dtype given, [1, B, N] in out_dtype. With silu: [1, B, N] = silu(gate) * up.
    Batch 1 only: norm = (g, eps) makes it the GEMV of rms_norm(x) * g (x: the float32
    residual stream; KNOBS["norm"]["FOLD"]); into (float32 [B, N]) gets the product added
    (atomically, every split) and is returned. w_gu: the layer's gate_up weight, for
    _l2_prefetch; l2_next: a later GEMV's weight that the programs pull into L2 as they finish
    (_l2_whole; in place of _l2_prefetch's). down (with silu, norm and into; KNOBS["mlp"]
    ["FUSED"]): the down weight [K, N]: into (zeros) gets x + down(silu(gate) * up) added, the
    MLP in one kernel. zero (a float32 tensor): zeroed by the kernel after its wait.
    heads (batch 1, the FMA path; KNOBS["combine"]["IN_O"]; _attention's tuple: the heads'
    denominators and the overflow flag, the splits' partials po / pm / pl, the model-dtype
    attention output buffer to merge them into, the head dim and the split count): x is the
    attention splits' float32 sums, divided by their heads' denominators as it is loaded.
    rope (batch 1, SPLIT_K 1; _decode's tuple: q [1, 1, H*hd], the cos / sin tables, positions,
    slots, the layer's K and V caches, H, KV, hd): w is qkv's weight; the kernel RoPEs q and
    k, writes q into q and this step's k and v into the caches, and q is returned.
    """
    kn = KNOBS[knob]
    B, K = x.shape
    N = w.shape[0] // 2 if silu else w.shape[0]
    if kn.get("SMEM") and norm is not None and not silu and into is None and rope is None and zero is None:
        limit = _smem_capable(x.device)
        if limit:
            return _gemv_smem(x, w, knob, out_dtype or x.dtype, pdl, norm, limit)
    split = 1 if silu or knob == "lm_head" else max(1, int(kn["SPLIT_K"]))
    bn, bk = int(kn["BLOCK_N"]), int(kn["BLOCK_K"])
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    even_k = k_split * split == K  # no partial K block anywhere: loads need no K mask
    use_dot = B >= int(KNOBS["gemv_dot_min_rows"])
    bb = max(16, int(KNOBS["gemv_dot_block_b"])) if use_dot else 1
    if use_dot:
        bn = max(16, int(kn.get("DOT_BLOCK_N", bn)))
    if (norm is not None or into is not None) and (use_dot or B != 1):
        raise ValueError("a folded norm or an atomic add: one row, on the FMA path")
    if down is not None and (not silu or norm is None or into is None or tuple(down.shape) != (K, N)):
        raise ValueError("the fused MLP: silu, a folded norm, an output to add into and a [K, N] down weight")
    if zero is not None and (zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError("the buffer to zero: contiguous float32")
    if heads is not None:
        den, po, pm, pl, xo, xh, xns = heads
        if use_dot or B != 1 or x.dtype != torch.float32 or K % xh or den.numel() != K // xh + 1:
            raise ValueError("the attention's sums as x: one row, on the FMA path, float32 [H * hd], and H "
                             "denominators and a flag")
    else:
        den = po = pm = pl = xo = w
        xh = xns = 0
    if rope is not None:
        q, cos, sin, pos, slots, kc, vc, H, KV, hd = rope
        if use_dot or B != 1 or split != 1 or silu or into is not None or N != (H + 2 * KV) * hd or bn % 2 or hd % bn:
            raise ValueError("qkv's RoPE: one row, unsplit, BLOCK_N even and dividing the head dim")
    else:
        q = cos = sin = pos = slots = kc = vc = w
        H = KV = hd = 1
    dtype = torch.float32 if split > 1 or out_dtype is None else out_dtype
    out = into if into is not None else torch.empty(split, B, N, device=x.device, dtype=dtype)
    g, eps = norm if norm is not None else (w, 0.0)
    grid = (triton.cdiv(N, bn), split, triton.cdiv(B, bb))
    pf_steps = min(int(kn.get("PF_STEPS", 0)), k_split // bk) if pdl else 0
    pre = _pow2_floor(min(int(kn.get("PRE", 0)), k_split // bk))
    wd = down if down is not None else w
    _gemv_kernel[grid](x, w, out, B, N, K, k_split, N if silu else 0,
                       x.stride(0), w.stride(0), *((0, out.stride(0)) if into is not None else out.stride()[:2]),
                       SILU=silu, USE_DOT=use_dot, IEEE=x.dtype == torch.float32, EVEN_K=even_k,
                       REDUCE_EACH=bool(kn.get("REDUCE_EACH", KNOBS.get("gemv_reduce_each_step", False))),
                       BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk,
                       PDL=_early(pdl, "mlp" if down is not None else knob), PF_STEPS=max(0, pf_steps),
                       PF_W=max(1, bk // _line(w)), PRE_K=pre * bk,
                       PIPE=bool(kn["PIPE"]), EVW="evict_first" if KNOBS["l2"]["WEIGHTS_EVICT_FIRST"] else "",
                       LOOP_STAGES=int(kn.get("LOOP_STAGES", 0)),
                       g_ptr=g, eps=eps, FOLD=norm is not None, SS_ROW=norm is not None and split > 1,
                       BLOCK_D=_pow2(K) if norm is not None and split > 1 else 1,
                       ATOMIC=into is not None and down is None,
                       **(_l2_whole(pdl, l2_next, kn["num_warps"]) or _l2_prefetch(knob, pdl, w_gu, w, kn["num_warps"])),
                       wd_ptr=wd, stride_dj=wd.stride(1), stride_dn=wd.stride(0), DOWN=down is not None,
                       DOWN_PRE=down is not None and bool(KNOBS["mlp"]["DOWN_PRE"]),
                       z_ptr=zero if zero is not None else x, Z_BLOCK=_pow2(zero.numel()) if zero is not None else 0,
                       z_n=zero.numel() if zero is not None else 0,
                       den_ptr=den, po_ptr=po, pm_ptr=pm, pl_ptr=pl, xo_ptr=xo, XH=xh, XNS=xns,
                       XNS_P=_pow2(max(1, xns)),
                       ROPE=rope is not None, q_ptr=q, cos_ptr=cos, sin_ptr=sin, pos_ptr=pos, slot_ptr=slots,
                       kc_ptr=kc, vc_ptr=vc, stride_cos=cos.stride(0) if rope is not None else 0,
                       **(dict(zip(("s_slot", "s_head", "s_seq"), kc.stride()[:3])) if rope is not None
                          else dict(s_slot=0, s_head=0, s_seq=0)),
                       RH=H, RKV=KV, RHD=hd,
                       num_warps=kn["num_warps"], num_stages=kn["num_stages"],
                       **({"maxnreg": int(kn["maxnreg"])} if kn.get("maxnreg") else {}), **_launch(pdl))
    return q if rope is not None else out


def _smem_capable(dev: torch.device) -> int:
    """The shared memory a program may take on `dev` where Gluon's kernels run (CUDA, compute
    capability 8.0 or newer, not the interpreter); 0 elsewhere."""
    if not HAVE_GLUON or dev.type != "cuda" or _interpreting() or torch.cuda.get_device_capability(dev)[0] < 8:
        return 0
    return int(getattr(torch.cuda.get_device_properties(dev), "shared_memory_per_block_optin", 0))


def _gl_desc(t: torch.Tensor, block: list[int]):
    """A bulk-copy (TMA) descriptor of 2-D `t` in `block` boxes, in the shared layout Gluon
    picks for them."""
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, el))


def _gemv_smem(x, w, knob, out_dtype, pdl, norm, limit):
    """_gemv's FOLD GEMV (one row, unsplit) by _gemv_smem_kernel: [1, 1, N] in out_dtype
    (limit: the shared memory a program may take)."""
    kn = KNOBS[knob]
    (_, K), N = x.shape, w.shape[0]
    bn, bk, nw = int(kn["BLOCK_N"]), int(kn["BLOCK_K"]), int(kn["num_warps"])
    smem = bn * K * w.element_size()
    if K % bk or bk & (bk - 1) or not 8 <= bk <= 256 or bn & (bn - 1) or smem > limit - 1024:
        raise ValueError(f"{knob}'s SMEM: BLOCK_K {bk} a power of two in 8..256 dividing K {K}, BLOCK_N {bn} a "
                         f"power of two whose rows ({smem} bytes) fit in shared memory ({limit})")
    mode = kn["SMEM"]
    if mode not in ("async", "tma") or (mode == "tma" and (N % bn or bn > 256 or bk * w.element_size() > 128)):
        raise ValueError(f'{knob}\'s SMEM {mode!r}: "async" or "tma" (BLOCK_N <= 256 dividing N {N}, BLOCK_K '
                         f'columns of at most 128 bytes)')
    out = torch.empty(1, 1, N, device=x.device, dtype=out_dtype)
    g, eps = norm
    desc = _gl_desc(w, [bn, bk]) if mode == "tma" else w
    _gemv_smem_kernel[(triton.cdiv(N, bn),)](x, w, out, g, eps, N, w.stride(0), K=K, BLOCK_N=bn, BLOCK_K=bk, NW=nw,
                                             PDL=_early(pdl, knob),
                                             EVW="evict_first" if KNOBS["l2"]["WEIGHTS_EVICT_FIRST"] else "",
                                             TMA=mode == "tma", w_desc=desc,
                                             num_warps=nw,
                                             **({"maxnreg": int(kn["maxnreg"])} if kn.get("maxnreg") else {}),
                                             **_launch(pdl))
    return out


def _o_gate_up_ready(dev: torch.device, fold: bool) -> bool:
    """KNOBS["o_gate_up"]["FUSED"] applies: on, the norms folded (batch 1), the GEMV stage on,
    and a device that runs Gluon's bulk tensor copies (compute capability 9.0+, not the
    interpreter: elsewhere o_proj and gate_up run as their own kernels, the same step)."""
    return bool(KNOBS["o_gate_up"]["FUSED"]) and fold and _stage("gemv") and HAVE_GLUON and _pdl_capable(dev)


def _sms(dev: torch.device) -> tuple[int, int]:
    """The device's SMs and the shared memory of one."""
    props = torch.cuda.get_device_properties(dev)
    return props.multi_processor_count, int(getattr(props, "shared_memory_per_multiprocessor", 0))


def _o_gate_up(a, wo, x, w_gu, norm, pdl, bar):
    """x += a @ wo^T, then [1, I] silu(gate) * up of rms_norm(x) * g (w_gu: [gate; up], [2I, D];
    norm: (g, eps)) by _o_gate_up_kernel, one program per KNOBS["o_gate_up"]["BLOCK_N"] gate
    rows; bar: a zeroed int32 counter, this call's grid barrier."""
    kn = KNOBS["o_gate_up"]
    D, KO, I, K = wo.shape[0], wo.shape[1], w_gu.shape[0] // 2, w_gu.shape[1]
    bn, nw, es = int(kn["BLOCK_N"]), int(kn["num_warps"]), w_gu.element_size()
    bk = 128 // es  # a box row of 128 bytes
    sub = max(1, min(int(kn["STAGE_K"]), K) // bk)  # boxes a stage
    nprog = I // max(1, bn)
    bo = _pow2(triton.cdiv(D, max(1, nprog)))
    stages = min(int(kn["STAGES"]), K // (sub * bk))
    early = min(int(kn["EARLY"]), stages)
    smem = (KO // bk * bo + 2 * stages * sub * bn) * bk * es + 4 * (2 * K + KO) + 8 * (stages + 1)
    limit = _smem_capable(x.device)
    sms, sm_smem = _sms(x.device)  # programs that fit at once: by shared memory, and by registers at 255 a thread
    resident = sms * max(1, min(sm_smem // (smem + 1024), 65536 // (nw * 32 * 256)))
    if (K != D or I % bn or bn & (bn - 1) or not 8 <= bn <= 256 or K % (sub * bk) or KO % bk or bo > 256
            or stages < 1 or early < 0 or smem > limit - 1024 or nw & (nw - 1) or not 1 <= nw <= 8
            or nprog > resident):
        raise ValueError(f'KNOBS["o_gate_up"]: BLOCK_N {bn} (a power of two in 8..256 dividing {I} gate rows, '
                         f'all {resident} resident at once), STAGE_K {kn["STAGE_K"]} (a multiple of {bk} dividing {K}), '
                         f'STAGES {kn["STAGES"]}, EARLY {kn["EARLY"]}, num_warps {nw}: {smem} bytes of shared memory '
                         f'a program against {limit}, o rows {bo} a program')
    wo_desc, wgu_desc = _gl_desc(wo, [bo, bk]), _gl_desc(w_gu, [bn, bk])
    g, eps = norm
    act = torch.empty(1, I, device=x.device, dtype=a.dtype)
    _o_gate_up_kernel[(nprog,)](a, x, g, act, bar, eps, D, I, wo_desc, wgu_desc, K=K, KO=KO, BO=bo, BN=bn, BK=bk,
                                SUB=sub, STAGES=stages, EARLY=early, NPROG=nprog, NW=nw,
                                PDL=_early(pdl, "o_gate_up"), SPIN_LIMIT=int(kn["SPIN_LIMIT"]), num_warps=nw,
                                **_launch(pdl))
    return act


def _linear(x, w, knob, silu=False, pdl=False, w_gu=None, l2_next=None, rope=None):
    """[1 or SPLIT, B, N] partials of x @ w^T (Triton GEMV, or F.linear when that stage is off;
    rope: _gemv's, with the GEMV stage on)."""
    if _stage("gemv"):
        return _gemv(x, w, knob, out_dtype=x.dtype, silu=silu, pdl=pdl, w_gu=w_gu, l2_next=l2_next, rope=rope)
    if silu:
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return (F.silu(gate) * up)[None]
    return F.linear(x, w)[None]


def _add_norm(x, h, branch, weight, eps, tokens=None, emb=None, pdl=False, norm=True):
    """x += sum(branch) (rounded as the reference rounds); h = rms_norm(x). With tokens/emb:
    x = emb[tokens] first. In place on x [B, D] and h [B, D]. norm=False: x only (h unused)."""
    B, D = x.shape
    if _stage("norm"):
        br = branch if branch is not None else x
        tok = tokens if tokens is not None else x
        e = emb if emb is not None else x
        _add_norm_kernel[(B,)](x, h, br, weight, tok, e, D, br.shape[0] if branch is not None else 0,
                               br.stride(0) if branch is not None else 0,
                               br.stride(1) if branch is not None else 0,
                               tok.stride(0) if tokens is not None else 0,
                               e.stride(0) if emb is not None else 0, eps,
                               GATHER=tokens is not None, HAS_BRANCH=branch is not None,
                               BLOCK_D=_pow2(D), PDL=_early(pdl, "norm"), NORM=norm,
                               num_warps=KNOBS["norm"]["num_warps"], **_launch(pdl))
        return
    if tokens is not None:
        x.copy_(F.embedding(tokens, emb))
    if branch is not None:
        x.add_(branch.sum(0).to(x.dtype) if branch.shape[0] > 1 else branch[0].to(x.dtype))
    if norm:
        h.copy_(F.rms_norm(x, (D,), weight, eps))


def _attn_cluster_ready(dev, B, dtype, fuse, exact, nsplit, G, hd) -> bool:
    """KNOBS["attn"]["CLUSTER"] applies: batch 1, bf16, online softmax with RoPE fused, NSPLIT a
    power of two in 2..16 (the cluster's CTAs) dividing G * hd, and a device that runs Gluon's
    cluster launches (compute capability 9.0+, not the interpreter)."""
    return (bool(KNOBS["attn"].get("CLUSTER", False)) and B == 1 and dtype == torch.bfloat16 and fuse
            and not exact and nsplit in (2, 4, 8, 16) and (G * hd) % nsplit == 0 and G & (G - 1) == 0
            and hd & (hd - 1) == 0 and HAVE_GLUON and _pdl_capable(dev))


@functools.lru_cache(maxsize=None)
def _cluster_layouts(G: int, hd: int, nc: int, nw: int):
    """The layouts of _attn_cluster_kernel (L3, LQ, LC), replicated over nc CTAs."""
    cga = nc.bit_length() - 1
    out = G * hd // nc
    return (gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, nw, 1], [2, 1, 0], cga_layout=[[0, 0, 0]] * cga),
            gl.BlockedLayout([1, 2], [4, 8], [1, nw], [1, 0], cga_layout=[[0, 0]] * cga),
            gl.BlockedLayout([1, 1], [32 // min(out, 32), min(out, 32)], [nw, 1], [1, 0], cga_layout=[[0, 0]] * cga))


def _attention(state, layer, qkv, batch, pos, slots, pdl=False, w_next=None, w_gu=None, l2_next=None,
               roped=False, sums=None):
    """qkv partials [NP, B, (H+2KV)*hd] -> (attention output [B, H*hd] in the model dtype,
    None), after writing this step's K/V into (slots[b], pos[b]) of `layer`'s cache. sums
    (KNOBS["combine"]["IN_O"], as _decode decides: batch 1, online softmax, NSPLIT > 1, no
    CLUSTER; float32 [H*hd + H + 1]: the heads' sums, their denominators, the overflow flag;
    zeroed by qkv's kernel): the splits add into it and no combine kernel runs; returns (its
    [1, H*hd] sums, the `heads` tuple for o_proj's _gemv). roped (the
    attention stage on): qkv is q [1, B, H*hd], RoPE'd, and this step's K/V are written (qkv's
    ROPE): the attention kernels only read. With PDL and
    KNOBS["pdl"]["PREFETCH_O"], the first attention kernel prefetches `w_next` into L2; and
    w_gu (the layer's gate_up weight) as _l2_prefetch says, or all of l2_next (the next
    layer's qkv weight, KNOBS["l2"]["QKV_NEXT"]) at KNOBS["l2"]["AT"] in its place."""
    cfg = state.config
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    NP, B, _ = qkv.shape
    dtype = state.dtype
    if not _stage("attention"):  # the reference's RoPE, K/V write and attention
        flat = (qkv.sum(0) if NP > 1 else qkv[0]).to(dtype).view(B, 1, H + 2 * KV, hd)
        cos = state.tables["rope_cos"][batch.positions].unsqueeze(2)
        sin = state.tables["rope_sin_rot"][batch.positions].unsqueeze(2)
        qk = apply_rope(flat[:, :, :H + KV], cos, sin)
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        return ref_attention(state, layer, q, k, flat[:, :, H + KV:].transpose(1, 2), batch).view(B, H * hd), None
    kc, vc = state.k_cache[layer], state.v_cache[layer]
    cos, sin = state.tables["rope_cos"], state.tables["rope_sin_rot"]
    ka = KNOBS["attn"]
    fuse = bool(ka.get("FUSE_ROPE", False)) and not roped
    o = torch.empty(B, H * hd, device=qkv.device, dtype=dtype)
    if roped:
        q = qkv[0]
    elif fuse:
        q = o  # unused: the attention kernels RoPE q themselves (and write this step's K/V)
    else:
        q = torch.empty(B, H * hd, device=qkv.device, dtype=dtype)
        _rope_kv_kernel[(B,)](qkv, q, cos, sin, pos, slots, kc, vc,
                              NP, qkv.stride(0), qkv.stride(1), pos.stride(0), slots.stride(0), cos.stride(0),
                              kc.stride(0), kc.stride(1), kc.stride(2),
                              H=H, KV=KV, HD=hd, HALF=hd // 2, NH_P=_pow2(H + KV), KV_P=_pow2(KV),
                              PDL=pdl, num_warps=KNOBS["rope"]["num_warps"], **_launch(pdl))
    nsplit = max(1, int(ka["NSPLIT"]))
    exact = bool(ka["EXACT_SOFTMAX"])
    G = H // KV
    if nsplit > 1:
        po = torch.empty(B, H, nsplit, hd, device=qkv.device, dtype=torch.float32)
        pm = torch.empty(B, H, nsplit, device=qkv.device, dtype=torch.float32)
        pl = torch.empty(B, H, nsplit, device=qkv.device, dtype=torch.float32)
    else:
        po = pm = pl = o
    if sums is not None and (B != 1 or exact or nsplit == 1 or sums.numel() != H * hd + H + 1):
        raise ValueError("the attention's sums (IN_O): one row, online softmax, NSPLIT > 1, [H * hd + H + 1] floats")
    den = sums[H * hd:] if sums is not None else o  # the heads' denominators, then the overflow flag
    if sums is None and nsplit > 1 and _attn_cluster_ready(qkv.device, B, dtype, fuse, exact, nsplit, G, hd):
        nw = int(ka["num_warps"])
        l3, lq, lc = _cluster_layouts(G, hd, nsplit, nw)
        _attn_cluster_kernel[(KV,)](qkv, kc, vc, pos, slots, cos, sin, o, po, pm, pl, hd ** -0.5, NP, qkv.stride(0),
                                    cos.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
                                    H=H, G=G, HD=hd, NC=nsplit, BS=int(ka["BLOCK_S"]), L3=l3, LQ=lq, LC=lc,
                                    PDL=_early(pdl, "attn"),
                                    KV_EV="evict_last" if KNOBS["l2"]["KV_EVICT_LAST"] else "",
                                    num_warps=nw, num_ctas=nsplit, **_launch(pdl))
        return o, None
    args = (q, kc, vc, pos, slots, o, po, pm, pl, hd ** -0.5, pos.stride(0), slots.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2))
    rope = (qkv, cos, sin, NP, qkv.stride(0), qkv.stride(1), cos.stride(0))
    meta = dict(H=H, G=G, GP=max(16, _pow2(G)), HD=hd, NSPLIT=nsplit, NS_P=_pow2(nsplit),
                BLOCK_S=int(ka["BLOCK_S"]), IEEE=dtype == torch.float32, PDL=_early(pdl, "attn"),
                num_warps=ka["num_warps"], num_stages=ka["num_stages"], **_launch(pdl))
    # PDL: the first attention kernel prefetches o_proj's weight, read two kernels later
    pf = pdl and w_next is not None and bool(KNOBS["pdl"]["PREFETCH_O"])
    pf_t = w_next if pf else o
    phases = ([1] if exact and nsplit > 1 else []) + [2 if exact else 0]
    # the first kernel's L2 prefetch (the next qkv weight, else gate_up's steps), the rest none
    l2_first = (_l2_whole(pdl, l2_next, ka["num_warps"], _L2_AT[KNOBS["l2"]["AT"]]) if l2_next is not None else {}
                ) or _l2_prefetch("attn", pdl, w_gu, o, ka["num_warps"])
    l2_rest = _l2_prefetch("", pdl, w_gu, o, ka["num_warps"])
    for i, phase in enumerate(phases):
        _attn_kernel[(B, KV, nsplit)](*args, pf_t, max(1, pf_t.numel() // _line(pf_t)), *rope, PHASE=phase,
                                      PF_LINE=_line(pf_t), PF_CHUNK=256 if pf and i == 0 else 0,
                                      FUSE_ROPE=fuse, WRITE_KV=fuse and i == 0,
                                      PRELOAD_KV=bool(ka.get("PRELOAD_KV", False)),
                                      EARLY_INPUTS=bool(ka.get("EARLY_INPUTS", False)),
                                      KV_EV="evict_last" if KNOBS["l2"]["KV_EVICT_LAST"] else "",
                                      **(l2_first if i == 0 else l2_rest),
                                      sum_ptr=sums if sums is not None else o,
                                      den_ptr=den, B_H=B * H,
                                      SUM=sums is not None,
                                      **meta)
    if sums is not None:
        return sums[:H * hd].view(1, H * hd), (den, po, pm, pl, o, hd, nsplit)
    if nsplit > 1:
        _attn_combine_kernel[(B * H,)](o, po, pm, pl, HD=hd, NSPLIT=nsplit, NS_P=_pow2(nsplit),
                                       WEIGHTED=not exact, PDL=_early(pdl, "combine"),
                                       num_warps=KNOBS["combine"]["num_warps"],
                                       **_launch(pdl))
    return o, None


def _decode(state, batch):
    cfg, w, t = state.config, state.weights, state.tables
    B, D, eps = batch.size, cfg.hidden_size, cfg.norm_eps
    dev, dtype = state.device, state.dtype
    tokens = batch.tokens[:, 0]
    pos = batch.positions[:, -1]
    slots = batch.slots
    # KNOBS["norm"]["FOLD"] (batch 1, FMA GEMVs): no norm kernels. The residual stream is
    # float32, o and down add their products into it (atomically, every split) and each GEMV
    # after a norm folds that norm in (_gemv's norm); one kernel first for the embedding row
    fold = (B == 1 and B < int(KNOBS["gemv_dot_min_rows"]) and KNOBS["norm"].get("FOLD", False)
            and _stage("norm") and _stage("gemv"))
    x = torch.empty(B, D, device=dev, dtype=torch.float32 if fold else dtype)  # the residual stream
    # KNOBS["mlp"]["FUSED"] (with FOLD): each layer's MLP adds x + its output into the other
    # residual buffer (zeroed by the layer's qkv), and the two swap
    fused = fold and bool(KNOBS["mlp"]["FUSED"])
    x_next = torch.empty(B, D, device=dev, dtype=torch.float32) if fused else None
    h = x if fold else torch.empty(B, D, device=dev, dtype=dtype)  # its normed copy, input of the next GEMV
    emb = w["model.embed_tokens.weight"]
    pdl = _pdl(dev)
    branch = None  # partials of the last projection, added to x by the next norm
    first = True

    def normed_gemv(weight, norm_w, knob, silu=False, w_gu=None, l2_next=None, rope=None, **fold_kw):
        """_add_norm (the first: x = embed[tokens]), then the GEMV of h; FOLD: the GEMV of
        rms_norm(x) itself (the first after the embedding row's own kernel; fold_kw: _gemv's
        down, into and zero). rope: _gemv's."""
        nonlocal first
        if first or not fold:
            _add_norm(x, h, branch, norm_w, eps, tokens if first else None, emb if first else None, pdl=pdl,
                      norm=not fold)
        first = False
        if fold:
            return _gemv(x, weight, knob, out_dtype=dtype, silu=silu, pdl=pdl, norm=(norm_w, eps), w_gu=w_gu,
                         l2_next=l2_next, rope=rope, **fold_kw)
        return _linear(h, weight, knob, silu=silu, pdl=pdl, w_gu=w_gu, l2_next=l2_next, rope=rope)

    def project(a, weight, knob, w_gu=None, l2_next=None, heads=None):
        """The branch for the next norm to add (FOLD: added into x now, none left). heads:
        _gemv's (a: the attention's sums; FOLD only)."""
        if fold:
            _gemv(a, weight, knob, pdl=pdl, into=x, w_gu=w_gu, l2_next=l2_next, heads=heads)
            return None
        return _linear(a, weight, knob, pdl=pdl, w_gu=w_gu, l2_next=l2_next)

    # KNOBS["qkv"]["ROPE"] (batch 1, FMA GEMVs): qkv's kernel RoPEs q and k and writes q and the
    # step's K/V itself (_gemv's rope); the attention kernels only read
    roped = (B == 1 and B < int(KNOBS["gemv_dot_min_rows"]) and bool(KNOBS["qkv"].get("ROPE", False))
             and _stage("gemv") and _stage("attention"))
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers, l2 = list(state.layers), KNOBS["l2"]
    # KNOBS["o_gate_up"]["FUSED"]: each layer's o_proj and gate_up in one kernel, a zeroed grid
    # barrier counter a layer
    ogu = not fused and _o_gate_up_ready(dev, fold)
    bars = torch.zeros(len(layers), device=dev, dtype=torch.int32) if ogu else None
    # KNOBS["combine"]["IN_O"] (with FOLD, neither MLP nor o_proj fused): the attention splits
    # add into one float32 buffer of the heads' sums and denominators (zeroed by each layer's
    # qkv) and o_proj divides as it loads: no combine kernel
    ka = KNOBS["attn"]
    in_o = (fold and not fused and not ogu and bool(KNOBS["combine"].get("IN_O", False)) and _stage("attention")
            and not ka["EXACT_SOFTMAX"] and int(ka["NSPLIT"]) > 1 and not ka.get("CLUSTER", False))
    sums = torch.empty(H * hd + H + 1, device=dev, dtype=torch.float32) if in_o else None  # sums, dens, flag
    for i, layer in enumerate(layers):
        p = f"model.layers.{layer}."
        w_gu = t[p + "mlp.gate_up_proj.weight"]
        rope = ((torch.empty(1, B, H * hd, device=dev, dtype=dtype), t["rope_cos"], t["rope_sin_rot"], pos, slots,
                 state.k_cache[layer], state.v_cache[layer], H, KV, hd) if roped else None)
        qkv = normed_gemv(t[p + "self_attn.qkv_proj.weight"], w[p + "input_layernorm.weight"], "qkv", w_gu=w_gu,
                          rope=rope, **({"zero": x_next.view(-1)} if fused else {"zero": sums} if in_o else {}))
        wo = w[p + "self_attn.o_proj.weight"]
        nq = (t[f"model.layers.{layers[i + 1]}.self_attn.qkv_proj.weight"]
              if l2.get("QKV_NEXT") and i + 1 < len(layers) and _stage("gemv") else None)
        o, heads = _attention(state, layer, qkv, batch, pos, slots, pdl=pdl, w_next=wo if _stage("gemv") else None,
                              w_gu=w_gu if _stage("gemv") else None, l2_next=nq, roped=roped, sums=sums)
        w_down = w[p + "mlp.down_proj.weight"]
        if ogu:  # o_proj and gate_up in one kernel (x += o's product inside it)
            act = _o_gate_up(o, wo, x, w_gu, (w[p + "post_attention_layernorm.weight"], eps), pdl, bars[i:])
            branch = project(act, w_down, "down")
            continue
        branch = project(o, wo, "o", w_gu=w_gu, heads=heads)
        if fused:  # x_next = x + mlp(x), one kernel
            if KNOBS["mlp"]["DOWN_T"]:  # the same [hidden, intermediate] matrix, rows of prepare's copy
                w_down = state.scratch[f"down_t.{layer}"].t()
            normed_gemv(w_gu, w[p + "post_attention_layernorm.weight"], "gate_up", silu=True, down=w_down,
                        into=x_next)
            x, x_next = x_next, x
            continue
        act = normed_gemv(w_gu, w[p + "post_attention_layernorm.weight"], "gate_up", silu=True,
                          l2_next=w_down if l2.get("END_DOWN") else None)[0]
        nxt = (t[f"model.layers.{layers[i + 1]}.self_attn.qkv_proj.weight"]
               if l2.get("END_QKV") and i + 1 < len(layers) else None)
        branch = project(act, w_down, "down", l2_next=nxt)
    return normed_gemv(lm_head_weight(state), w["model.norm.weight"], "lm_head")[0]
