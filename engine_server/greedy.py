"""Greedy choice of the next token on the device, fast enough to sit in every decode step.

`argmax(logits)` is `torch.argmax(logits, -1, keepdim=True)` to the bit: the index of the
first maximal value of each row, NaN counting as maximal (the first NaN wins). One argmax
over a whole 128K-entry vocabulary row keeps too few threads busy for batch-1 decode
(torch.argmax adds 26 us to a captured H200 step: benchmarks/results/h200_greedy.json), so
on CUDA a row is reduced in two passes: a (max, first index) per CHUNK-wide slice of the
row, then the first slice holding the row's maximum.

    impl "triton"    two Triton kernels (CUDA with Triton: the default there; +2-3 us)
    impl "two_pass"  the same two passes in torch ops (CUDA without Triton; +12 us)
    impl "torch"     torch.argmax (every other device, and rows shorter than two slices)

Every impl is graph-capturable (no host sync, no data-dependent shapes). Used by the serving
scheduler's greedy rows, the exactness harness's token streams and the benchmarks' captured
decode step.
"""

from __future__ import annotations

import torch

CHUNK = 256  # entries per slice, torch two-pass
TRITON_CHUNK = 512  # entries per slice (one program each), Triton

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _first_max(v, idx, BIG: tl.constexpr):
        """(max, index of its first occurrence) of float32 `v` over axis 0, NaN maximal (the
        first NaN's index, value NaN); `idx` the entries' indices (BIG where not an entry)."""
        nan = v != v
        m = tl.max(tl.where(nan, float("-inf"), v), axis=0)
        first = tl.min(tl.where(v == m, idx, BIG), axis=0)
        first_nan = tl.min(tl.where(nan, idx, BIG), axis=0)
        has_nan = first_nan < BIG
        return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first)

    @triton.jit
    def _argmax_part_kernel(x_ptr, pv_ptr, pi_ptr, V, stride_x, P, CHUNK: tl.constexpr):
        """Grid (P, B): slice p of row b -> its (max, first index) at pv/pi[b, p]."""
        p = tl.program_id(0)
        b = tl.program_id(1)
        o = p * CHUNK + tl.arange(0, CHUNK)
        m = o < V
        v = tl.load(x_ptr + b.to(tl.int64) * stride_x + o, mask=m, other=float("-inf")).to(tl.float32)
        mx, i = _first_max(v, tl.where(m, o, 2147483647), 2147483647)
        tl.store(pv_ptr + b * P + p, mx)
        tl.store(pi_ptr + b * P + p, i)

    @triton.jit
    def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, P, stride_out, BLOCK_P: tl.constexpr):
        """Grid (B,): the first slice holding row b's max -> its index into out[b]."""
        b = tl.program_id(0)
        s = tl.arange(0, BLOCK_P)
        m = s < P
        v = tl.load(pv_ptr + b * P + s, mask=m, other=float("-inf"))
        i = tl.load(pi_ptr + b * P + s, mask=m, other=2147483647)
        # slices are in order and each index is its slice's first: the first slice's index is
        # the row's first; rank the slices by position so ties go to the earliest
        _, first = _first_max(v, tl.where(m, s, 2147483647), 2147483647)
        tl.store(out_ptr + b * stride_out, tl.sum(tl.where(s == first, i, 0), axis=0).to(tl.int64))


def _default_impl(logits: torch.Tensor) -> str:
    if logits.device.type != "cuda":
        return "torch"
    return "triton" if HAVE_TRITON else "two_pass"


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """logits [B, V] -> int64 [B, 1], equal to torch.argmax(logits, -1, keepdim=True); with
    `out` ([B, 1] int64) written there as well and returned. impl: None picks by device."""
    B, V = logits.shape
    impl = impl or _default_impl(logits)
    if impl not in ("torch", "two_pass", "triton"):
        raise ValueError(f"unknown argmax impl {impl!r}: torch, two_pass or triton")
    chunk = TRITON_CHUNK if impl == "triton" else CHUNK
    if impl == "torch" or V < 2 * chunk or logits.stride(-1) != 1:
        return torch.argmax(logits, -1, keepdim=True, out=out)
    if impl == "triton":
        P = triton.cdiv(V, chunk)
        pv = torch.empty(B, P, device=logits.device, dtype=torch.float32)
        pi = torch.empty(B, P, device=logits.device, dtype=torch.int32)
        tok = out if out is not None else torch.empty(B, 1, device=logits.device, dtype=torch.int64)
        _argmax_part_kernel[(P, B)](logits, pv, pi, V, logits.stride(0), P, CHUNK=chunk, num_warps=4)
        _argmax_final_kernel[(B,)](pv, pi, tok, P, tok.stride(0), BLOCK_P=triton.next_power_of_2(P), num_warps=4)
        return tok
    n = V // chunk
    vals, idx = logits[:, :n * chunk].view(B, n, chunk).max(-1)  # [B, n]: each slice's first max
    if V > n * chunk:  # the short last slice
        tv, ti = logits[:, n * chunk:].max(-1, keepdim=True)
        vals, idx = torch.cat([vals, tv], 1), torch.cat([idx, ti], 1)
    j = vals.argmax(-1, keepdim=True)  # the first slice holding the row's max (NaN: the first NaN's)
    tok = idx.gather(-1, j) + j * chunk
    if out is not None:
        return out.copy_(tok)
    return tok
