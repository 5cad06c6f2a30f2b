"""Llama batch-1 decode as one persistent Triton kernel per layer, phases joined by grid barriers.

What it changes: for batch-1 decode steps on a CUDA device (sm_80+) each layer is ONE kernel
launch of one program per SM instead of ~8 dependent kernels; the program runs the layer's
phases in turn and waits at a grid barrier (a device counter, one per barrier per step)
between phases whose inputs other programs wrote:

    1  x -> h = rms_norm(x) (every program, from L2), qkv rows of its share = h @ Wqkv^T
       -- barrier --
    2  attention split (kv head, sequence split): RoPE q and k from qkv, this step's K/V
       cell written by the split that holds it, flash-decoding partials (m, l, acc)
       -- barrier --
    3  merge the splits of each q head -> o
       -- barrier --
    4  x[rows of its share] += o @ Wo^T
       -- barrier --
    5  h = rms_norm(x) (every program), act[rows of its share] = silu(h @ Wg^T) * (h @ Wu^T)
       -- barrier --
    6  x[rows of its share] += act @ Wdown^T               (the next layer's kernel waits for it)

and one more kernel for the final norm and lm_head. A program's share of a GEMV is a
contiguous range of output rows (the row counts of the model are not multiples of the SM
count: ranges keep every program within one tile of the others), streamed as tiles of
BLOCK_N full rows, the next tile's load in flight while the current one is reduced. Before
each barrier a program loads the first weight tile of its next phase (weights are never
written), so the barrier's wait overlaps the next phase's first HBM round trip; with PDL
(sm_90+) a layer's first tile is loaded before it waits for the kernel before it.

Everything else (prefill, batch > 1, devices or interpreters that cannot run co-resident
spinning programs, model features the kernels do not implement) runs the reference
(`engine_server.models.llama.forward`).

Measured on an H200 (Llama-3.2-1B, bf16, batch 1, context 512; benchmarks/results/
h200_variants_persistent.json, one run): 779.7 tok/s with these KNOBS (16 warps), 889.5 with
num_warps 8, against llama_triton_decode_h200.py's 1,175.7 and the reference's 508.1: correct
(tolerance gate, every greedy token the reference's) but slower than the PDL chain it
replaces. Its profile (h200_profile_persistent.txt): 74 us a layer kernel against that
chain's ~45 us a layer and a 28.7 us weight floor; the lm_head kernel 123.6 us, at the
floor. One tile in flight per program behind the one being reduced (32 KB a SM) is less than
HBM needs, and five barriers a layer are paid on top.

Numerics are those of llama_triton_decode_h200.py (online softmax, float32 accumulation,
rounded to the model dtype where the reference rounds): gate `check_bit_exact(mode=
"tolerance")` with identical greedy tokens on the full preset, not bitwise on CUDA.

Barriers: every program adds 1 to the barrier's counter with release semantics (one thread,
after a block barrier), and each thread polls it with acquire loads until the count reaches
the number of programs; loads of what other programs wrote also bypass L1 (.cg).
All programs must be resident at once: one program per SM, launched as the only work of
the step. A spin that runs past SPIN_LIMIT polls gives up (the step's results are then
wrong, and the gate says so) rather than hang the engine.

Contract kept: weights and tables are only read; K/V go only into the cell (slots[0],
positions[0, -1]) of the layers in `state.layers`; buffers and the barrier counters are
allocated per call (zeroed counters: the step is CUDA-graph capturable); nothing is kept
across calls.
"""

from __future__ import annotations

import os

import torch

from engine_server.models import llama as ref
from engine_server.models.common import lm_head_weight

KNOBS = {
    # rows per weight tile of each GEMV phase (full K: one tile is BLOCK_N whole rows);
    # down streams K in BLOCK_K columns per tile
    "qkv": {"BLOCK_N": 8},
    "o": {"BLOCK_N": 8},
    "gate_up": {"BLOCK_N": 4},
    "down": {"BLOCK_N": 16, "BLOCK_K": 1024},
    "lm_head": {"BLOCK_N": 8, "programs_per_sm": 2, "num_warps": 8},
    # attention: keys per loop step, sequence splits (KV heads x NSPLIT programs work, at most
    # one per program)
    "attn": {"BLOCK_S": 64, "NSPLIT": 16},
    "num_warps": 16,
    "SPIN_LIMIT": 262144,  # polls a barrier waits before it gives up (a wrong result, no hang)
    "pdl": True,
}

try:  # Triton is optional: without it every call runs the reference
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install
    HAVE_TRITON = False


def _supported(state, batch) -> bool:
    """Batch-1 decode on a CUDA device whose programs run concurrently, for the features here."""
    cfg = state.config
    if not HAVE_TRITON or batch.seq_len != 1 or batch.size != 1:
        return False
    if state.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False  # the interpreter runs programs one after another: a barrier would never open
    if cfg.is_moe or cfg.attention_bias or cfg.qk_norm or cfg.hidden_act != "silu":
        return False
    if torch.cuda.get_device_capability(state.device)[0] < 8:
        return False
    hd, D = cfg.head_dim, cfg.hidden_size
    pow2 = all(n & (n - 1) == 0 for n in (hd, D, cfg.num_heads * hd, KNOBS["attn"]["NSPLIT"]))
    sms = _sms(state.device)  # attention splits and heads: one program each
    return pow2 and cfg.num_heads % cfg.num_kv_heads == 0 and cfg.num_kv_heads * KNOBS["attn"]["NSPLIT"] <= sms \
        and cfg.num_heads <= sms


def forward(state, batch):
    if not _supported(state, batch):
        return ref.forward(state, batch)
    return _decode(state, batch)


# ---- kernels ---------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _to(x, like_ptr):
        """float32 `x` cast to the element type of `like_ptr` (round to nearest even)."""
        return x.to(like_ptr.dtype.element_ty)

    @triton.jit
    def _round(x, like_ptr):
        """Round float32 `x` to the element type of `like_ptr` and back (a reference rounding point)."""
        return _to(x, like_ptr).to(tl.float32)

    @triton.jit
    def _barrier(bar_ptr, NPROG: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        """Grid barrier on the zeroed int32 counter at bar_ptr (one counter per barrier per step):
        every write of every program before it is visible to every program after it."""
        tl.debug_barrier()  # the block's writes are ordered before its arrival
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")  # one thread of the program
        seen = _load_acquire(bar_ptr)  # every thread: its loads after it see what was released
        spins = tl.full([], 0, tl.int32)
        while (seen < NPROG) & (spins < SPIN_LIMIT):
            seen = _load_acquire(bar_ptr)
            spins += 1
        tl.debug_barrier()

    @triton.jit
    def _load_acquire(ptr):
        """ld.acquire.gpu of the int32 at ptr."""
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _share(pid, N, NPROG: tl.constexpr):
        """Program pid's contiguous range [lo, hi) of N rows."""
        return pid * N // NPROG, (pid + 1) * N // NPROG

    @triton.jit
    def _tile(w_ptr, r0, hi, c0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Weight rows r0..r0+BN (those < hi; none loaded past it), columns c0..c0+BK (those
        < K) of a row-major [*, K] matrix: [BN, BK] in its dtype."""
        rows = r0 + tl.arange(0, BN)
        cols = c0 + tl.arange(0, BK)
        mask = (rows < hi)[:, None]
        if K % BK != 0:
            mask = mask & (cols < K)[None, :]
        return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _normed(x_ptr, w_ptr, eps, D: tl.constexpr, GATHER: tl.constexpr, tok_ptr):
        """rms_norm of the residual row ([1, D] float32, rounded as the reference's norm):
        from x (written by other programs: read past L1), or with GATHER the embedding row."""
        cols = tl.arange(0, D)[None, :]
        if GATHER:
            tok = tl.load(tok_ptr).to(tl.int64)
            x = tl.load(x_ptr + tok * D + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        return _round(x * r[:, None] * w, x_ptr)

    @triton.jit
    def _gemv_rows(w_ptr, xrow, lo, hi, w0, out_ptr, res_ptr, res_src_ptr,
                   K: tl.constexpr, BN: tl.constexpr, RESIDUAL: tl.constexpr):
        """Rows lo..hi of w [*, K] times xrow ([1, K] float32), one [BN, K] tile at a time, the
        next in flight while this one is reduced (w0: the first tile, loaded by the caller).
        Stores out[r] = round(acc), or with RESIDUAL res[r] = round(res_src[r] + round(acc))."""
        w_cur = w0
        for i in range(0, tl.cdiv(hi - lo, BN)):
            r0 = lo + i * BN
            w_nxt = _tile(w_ptr, r0 + BN, hi, 0, K, BN, K)
            acc = tl.sum(w_cur.to(tl.float32) * xrow, axis=1)
            rows = r0 + tl.arange(0, BN)
            rm = rows < hi
            if RESIDUAL:
                x = tl.load(res_src_ptr + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(res_ptr + rows, _to(x + _round(acc, res_ptr), res_ptr), mask=rm)
            else:
                tl.store(out_ptr + rows, _to(acc, out_ptr), mask=rm)
            w_cur = w_nxt

    @triton.jit
    def _gemv_silu_rows(w_ptr, wu_ptr, xrow, lo, hi, g0, u0, out_ptr, K: tl.constexpr, BN: tl.constexpr):
        """act[r] = silu(h . w[r]) * (h . wu[r]) for rows lo..hi, with the reference's
        roundings (gate, up, silu(gate), product); g0 / u0: the first gate and up tiles."""
        g_cur = g0
        u_cur = u0
        for i in range(0, tl.cdiv(hi - lo, BN)):
            r0 = lo + i * BN
            g_nxt = _tile(w_ptr, r0 + BN, hi, 0, K, BN, K)
            u_nxt = _tile(wu_ptr, r0 + BN, hi, 0, K, BN, K)
            g = _round(tl.sum(g_cur.to(tl.float32) * xrow, axis=1), out_ptr)
            u = _round(tl.sum(u_cur.to(tl.float32) * xrow, axis=1), out_ptr)
            act = _round(g / (1.0 + tl.exp(-g)), out_ptr)
            rows = r0 + tl.arange(0, BN)
            tl.store(out_ptr + rows, _to(act * u, out_ptr), mask=rows < hi)
            g_cur = g_nxt
            u_cur = u_nxt

    @triton.jit
    def _gemv_k_rows(w_ptr, x_ptr, lo, hi, w0, res_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """res[r] = round(res[r] + round(w[r] . x)) for rows lo..hi of w [*, K], K streamed in
        BK columns per tile (x: written by other programs, read past L1); w0: the first tile."""
        NK: tl.constexpr = (K + BK - 1) // BK
        w_cur = w0
        acc = tl.zeros([BN], dtype=tl.float32)
        total = tl.cdiv(hi - lo, BN) * NK
        for it in range(0, total):
            nxt = it + 1
            r_n = lo + (nxt // NK) * BN
            w_nxt = _tile(w_ptr, r_n, tl.where(nxt < total, hi, 0), (nxt % NK) * BK, K, BN, BK)
            kc = it % NK
            xc = kc * BK + tl.arange(0, BK)[None, :]
            xk = tl.load(x_ptr + xc, mask=xc < K, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += tl.sum(w_cur.to(tl.float32) * xk, axis=1)
            if kc == NK - 1:
                rows = lo + (it // NK) * BN + tl.arange(0, BN)
                rm = rows < hi
                x = tl.load(res_ptr + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(res_ptr + rows, _to(x + _round(acc, res_ptr), res_ptr), mask=rm)
                acc = tl.zeros([BN], dtype=tl.float32)
            w_cur = w_nxt

    @triton.jit
    def _rope(row_ptr, heads, hm, d, cos_row, sin_row, like_ptr, HD: tl.constexpr):
        """Heads `heads` (rows masked by hm) of the qkv row, RoPE'd as common.apply_rope rounds
        (each product, then their sum): [N, HD] float32."""
        part = (d + HD // 2) % HD  # rotate-half partner
        base = row_ptr + heads[:, None] * HD
        x = tl.load(base + d[None, :], mask=hm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        xp = tl.load(base + part[None, :], mask=hm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        c = tl.load(cos_row + d).to(tl.float32)[None, :]
        sn = tl.load(sin_row + d).to(tl.float32)[None, :]
        return _round(_round(x * c, like_ptr) + _round(xp * sn, like_ptr), like_ptr)

    @triton.jit
    def _attn_split(pid, qkv_ptr, kc_ptr, vc_ptr, pos, slot, cos_ptr, sin_ptr, po_ptr, pm_ptr, pl_ptr,
                    scale, stride_cos, s_slot, s_head, s_seq,
                    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                    NSPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program pid < KV * NSPLIT: kv head pid // NSPLIT over split pid % NSPLIT of keys 0..pos
        (online softmax); the split holding pos first writes this step's K/V cell. Stores the
        unnormalised partials po [H, NSPLIT, HD], pm / pl [H, NSPLIT]."""
        kvh = pid // NSPLIT
        sp = pid % NSPLIT
        n = pos + 1
        chunk = tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK_S) * BLOCK_S
        start = sp * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, GP)
        gm = g < G
        d = tl.arange(0, HD)
        heads = kvh * G + g
        cos_row = cos_ptr + pos * stride_cos
        sin_row = sin_ptr + pos * stride_cos
        q = _rope(qkv_ptr, heads, gm, d, cos_row, sin_row, kc_ptr, HD)  # [GP, HD], model-dtype values
        base = slot.to(tl.int64) * s_slot + kvh * s_head
        if (pos >= start) & (pos < end):
            one = g == 0
            k = _rope(qkv_ptr, H + kvh + 0 * g, one, d, cos_row, sin_row, kc_ptr, HD)
            v = tl.load(qkv_ptr + (H + KV + kvh) * HD + d[None, :] + 0 * g[:, None], mask=one[:, None],
                        other=0.0, cache_modifier=".cg")
            cell = base + pos.to(tl.int64) * s_seq + 0 * g[:, None] + d[None, :]
            tl.store(kc_ptr + cell, _to(k, kc_ptr), mask=one[:, None])
            tl.store(vc_ptr + cell, v.to(vc_ptr.dtype.element_ty), mask=one[:, None])
            tl.debug_barrier()  # the block's own cache writes, visible to its loads below
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, HD], dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):
            offs = s0 + tl.arange(0, BLOCK_S)
            valid = offs < end
            kv_off = base + offs.to(tl.int64)[:, None] * s_seq + d[None, :]
            kt = tl.load(kc_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)  # [BS, HD]
            vt = tl.load(vc_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * kt[None, :, :], axis=2)  # [GP, BS]
            sc = _round(_round(sc, kc_ptr) * scale, kc_ptr)
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.sum(_round(p, vc_ptr)[:, :, None] * vt[None, :, :], axis=1)  # [GP, HD]
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        row = heads * NSPLIT + sp
        tl.store(po_ptr + row[:, None] * HD + d[None, :], acc, mask=gm[:, None])
        tl.store(pm_ptr + row, m_i, mask=gm)
        tl.store(pl_ptr + row, l_i, mask=gm)

    @triton.jit
    def _attn_merge(head, o_ptr, po_ptr, pm_ptr, pl_ptr, HD: tl.constexpr, NSPLIT: tl.constexpr):
        """o[head] = sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M) over the head's splits."""
        s = tl.arange(0, NSPLIT)
        d = tl.arange(0, HD)
        acc = tl.load(po_ptr + (head * NSPLIT + s)[:, None] * HD + d[None, :], cache_modifier=".cg")
        m = tl.load(pm_ptr + head * NSPLIT + s, cache_modifier=".cg")
        l = tl.load(pl_ptr + head * NSPLIT + s, cache_modifier=".cg")
        wgt = tl.exp(m - tl.max(m, axis=0))
        wgt = tl.where(m == float("-inf"), 0.0, wgt)
        out = tl.sum(acc * wgt[:, None], axis=0) / tl.sum(l * wgt, axis=0)
        tl.store(o_ptr + head * HD + d, _to(out, o_ptr))

    @triton.jit
    def _layer_kernel(x_ptr, qkv_ptr, o_ptr, act_ptr, po_ptr, pm_ptr, pl_ptr, bar_ptr,
                      tok_ptr, emb_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                      wn1_ptr, wqkv_ptr, wo_ptr, wn2_ptr, wgu_ptr, wd_ptr, kc_ptr, vc_ptr,
                      eps, scale, stride_cos, s_slot, s_head, s_seq,
                      D: tl.constexpr, I: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
                      G: tl.constexpr, GP: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
                      BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
                      BN_D: tl.constexpr, BK_D: tl.constexpr,
                      FIRST: tl.constexpr, NPROG: tl.constexpr, SPIN_LIMIT: tl.constexpr, PDL: tl.constexpr):
        """One layer of a batch-1 decode step, grid (NPROG,), every program resident; see the
        module docstring for the phases. x: the residual row [D] (FIRST: taken from the
        embedding of tok, and written by phase 4), model dtype; bar_ptr: 5 zeroed counters."""
        pid = tl.program_id(0)
        NQKV: tl.constexpr = (H + 2 * KV) * HD
        HQ: tl.constexpr = H * HD  # o_proj's input width
        q_lo, q_hi = _share(pid, NQKV, NPROG)
        w0 = _tile(wqkv_ptr, q_lo, q_hi, 0, D, BN_QKV, D)  # weights: before the wait
        if PDL:
            tl.extra.cuda.gdc_wait()
        pos = tl.load(pos_ptr).to(tl.int32)
        slot = tl.load(slot_ptr)
        # 1: norm, qkv
        if FIRST:
            h = _normed(emb_ptr, wn1_ptr, eps, D, True, tok_ptr)
        else:
            h = _normed(x_ptr, wn1_ptr, eps, D, False, tok_ptr)
        _gemv_rows(wqkv_ptr, h, q_lo, q_hi, w0, qkv_ptr, x_ptr, x_ptr, D, BN_QKV, False)
        o_lo, o_hi = _share(pid, D, NPROG)
        w0 = _tile(wo_ptr, o_lo, o_hi, 0, HQ, BN_O, HQ)
        _barrier(bar_ptr + 0, NPROG, SPIN_LIMIT)
        # 2: attention splits
        if pid < KV * NSPLIT:
            _attn_split(pid, qkv_ptr, kc_ptr, vc_ptr, pos, slot, cos_ptr, sin_ptr, po_ptr, pm_ptr, pl_ptr,
                        scale, stride_cos, s_slot, s_head, s_seq, H, KV, G, GP, HD, NSPLIT, BLOCK_S)
        _barrier(bar_ptr + 1, NPROG, SPIN_LIMIT)
        # 3: merge
        if pid < H:
            _attn_merge(pid, o_ptr, po_ptr, pm_ptr, pl_ptr, HD, NSPLIT)
        _barrier(bar_ptr + 2, NPROG, SPIN_LIMIT)
        # 4: o_proj + residual (the first layer's residual is the embedding row)
        orow = tl.load(o_ptr + tl.arange(0, HQ)[None, :], cache_modifier=".cg").to(tl.float32)
        if FIRST:
            tok = tl.load(tok_ptr).to(tl.int64)
            _gemv_rows(wo_ptr, orow, o_lo, o_hi, w0, x_ptr, x_ptr, emb_ptr + tok * D, HQ, BN_O, True)
        else:
            _gemv_rows(wo_ptr, orow, o_lo, o_hi, w0, x_ptr, x_ptr, x_ptr, HQ, BN_O, True)
        g_lo, g_hi = _share(pid, I, NPROG)
        wup_ptr = wgu_ptr + I * D  # the up rows follow the gate rows
        g0 = _tile(wgu_ptr, g_lo, g_hi, 0, D, BN_GU, D)
        u0 = _tile(wup_ptr, g_lo, g_hi, 0, D, BN_GU, D)
        _barrier(bar_ptr + 3, NPROG, SPIN_LIMIT)
        # 5: norm, gate_up, SiLU
        h = _normed(x_ptr, wn2_ptr, eps, D, False, tok_ptr)
        _gemv_silu_rows(wgu_ptr, wup_ptr, h, g_lo, g_hi, g0, u0, act_ptr, D, BN_GU)
        d_lo, d_hi = _share(pid, D, NPROG)
        w0 = _tile(wd_ptr, d_lo, d_hi, 0, I, BN_D, BK_D)
        _barrier(bar_ptr + 4, NPROG, SPIN_LIMIT)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # the next layer may launch and load its weights
        # 6: down + residual
        _gemv_k_rows(wd_ptr, act_ptr, d_lo, d_hi, w0, x_ptr, I, BN_D, BK_D)

    @triton.jit
    def _head_kernel(x_ptr, tok_ptr, emb_ptr, wn_ptr, w_ptr, out_ptr, eps, V, D: tl.constexpr, BN: tl.constexpr,
                     GATHER: tl.constexpr, NPROG: tl.constexpr, PDL: tl.constexpr):
        """logits[r] = rms_norm(x) . lm_head[r] for the program's share of the V rows (GATHER,
        no layers: x is the embedding row of tok)."""
        pid = tl.program_id(0)
        lo, hi = _share(pid, V, NPROG)
        w0 = _tile(w_ptr, lo, hi, 0, D, BN, D)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if GATHER:
            h = _normed(emb_ptr, wn_ptr, eps, D, True, tok_ptr)
        else:
            h = _normed(x_ptr, wn_ptr, eps, D, False, tok_ptr)
        _gemv_rows(w_ptr, h, lo, hi, w0, out_ptr, x_ptr, x_ptr, D, BN, False)


# ---- launcher ---------------------------------------------------------------------------

NBAR = 8  # counters a layer (5 barriers; 8 keeps each layer's 32-byte aligned: one kernel specialisation)


def _launch(pdl: bool) -> dict:
    """Launch options: PDL for the kernels after the first layer's (before it, only the
    counters' zero fill)."""
    return {"launch_pdl": True} if pdl else {}


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _decode(state, batch):
    cfg, w, t = state.config, state.weights, state.tables
    D, I, eps = cfg.hidden_size, cfg.intermediate_size, cfg.norm_eps
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dev, dtype = state.device, state.dtype
    nprog = _sms(dev)
    pdl = bool(KNOBS["pdl"]) and torch.cuda.get_device_capability(dev)[0] >= 9
    nsplit = int(KNOBS["attn"]["NSPLIT"])
    x = torch.empty(D, device=dev, dtype=dtype)
    qkv = torch.empty((H + 2 * KV) * hd, device=dev, dtype=dtype)
    o = torch.empty(H * hd, device=dev, dtype=dtype)
    act = torch.empty(I, device=dev, dtype=dtype)
    po = torch.empty(H * nsplit * hd, device=dev, dtype=torch.float32)
    pm = torch.empty(H * nsplit, device=dev, dtype=torch.float32)
    pl = torch.empty(H * nsplit, device=dev, dtype=torch.float32)
    bar = torch.zeros(max(1, len(state.layers)) * NBAR, device=dev, dtype=torch.int32)
    tokens, pos, slots = batch.tokens[:, 0], batch.positions[:, -1], batch.slots
    cos, sin = t["rope_cos"], t["rope_sin_rot"]
    emb = w["model.embed_tokens.weight"]
    G = H // KV
    for i, layer in enumerate(state.layers):
        p = f"model.layers.{layer}."
        kc, vc = state.k_cache[layer], state.v_cache[layer]
        _layer_kernel[(nprog,)](
            x, qkv, o, act, po, pm, pl, bar[i * NBAR:], tokens, emb, pos, slots, cos, sin,
            w[p + "input_layernorm.weight"], t[p + "self_attn.qkv_proj.weight"], w[p + "self_attn.o_proj.weight"],
            w[p + "post_attention_layernorm.weight"], t[p + "mlp.gate_up_proj.weight"],
            w[p + "mlp.down_proj.weight"], kc, vc,
            eps, hd ** -0.5, cos.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
            D=D, I=I, H=H, KV=KV, HD=hd, G=G, GP=triton.next_power_of_2(G), NSPLIT=nsplit,
            BLOCK_S=int(KNOBS["attn"]["BLOCK_S"]), BN_QKV=int(KNOBS["qkv"]["BLOCK_N"]),
            BN_O=int(KNOBS["o"]["BLOCK_N"]), BN_GU=int(KNOBS["gate_up"]["BLOCK_N"]),
            BN_D=int(KNOBS["down"]["BLOCK_N"]), BK_D=min(int(KNOBS["down"]["BLOCK_K"]), triton.next_power_of_2(I)),
            FIRST=i == 0, NPROG=nprog, SPIN_LIMIT=int(KNOBS["SPIN_LIMIT"]), PDL=pdl and i > 0,
            num_warps=int(KNOBS["num_warps"]), num_stages=1, **_launch(pdl and i > 0))
    lm = lm_head_weight(state)
    kl = KNOBS["lm_head"]
    n_lm = nprog * int(kl["programs_per_sm"])
    logits = torch.empty(1, lm.shape[0], device=dev, dtype=dtype)
    _head_kernel[(n_lm,)](x, tokens, emb, w["model.norm.weight"], lm, logits, eps, lm.shape[0], D=D,
                          BN=int(kl["BLOCK_N"]), GATHER=not state.layers, NPROG=n_lm, PDL=pdl and bool(state.layers),
                          num_warps=int(kl["num_warps"]), num_stages=1, **_launch(pdl and bool(state.layers)))
    return logits
