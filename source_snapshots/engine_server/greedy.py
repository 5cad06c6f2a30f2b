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

On a GPU that has programmatic dependent launch (compute capability 9.0+), the two Triton
kernels launch with it: the first may start while the kernel before it (the logits' producer)
still runs and waits inside for that kernel's writes (griddepcontrol.wait), and lets the second
launch at its entry; no kernel boundary of the sampler waits on a launch. `advance` (a tensor of
B entries, the decode step's positions) gets 1 added to each entry once the choice is made, in
the second kernel on that path (a separate add elsewhere): a captured decode step's bookkeeping
in no kernel of its own.

Every impl is graph-capturable (no host sync, no data-dependent shapes). Used by the serving
scheduler's greedy rows, the exactness harness's token streams and the benchmarks' captured
decode step.
"""

from __future__ import annotations

import functools
import os

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
    def _argmax_part_kernel(x_ptr, pv_ptr, pi_ptr, V, stride_x, P, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Grid (P, B): slice p of row b -> its (max, first index) at pv/pi[b, p]. PDL: let the
        final kernel launch now, then wait for the logits' producer before reading them."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        p = tl.program_id(0)
        b = tl.program_id(1)
        o = p * CHUNK + tl.arange(0, CHUNK)
        m = o < V
        v = tl.load(x_ptr + b.to(tl.int64) * stride_x + o, mask=m, other=float("-inf")).to(tl.float32)
        mx, i = _first_max(v, tl.where(m, o, 2147483647), 2147483647)
        tl.store(pv_ptr + b * P + p, mx)
        tl.store(pi_ptr + b * P + p, i)

    @triton.jit
    def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, P, stride_out, adv_ptr, stride_adv,
                             BLOCK_P: tl.constexpr, PDL: tl.constexpr, ADVANCE: tl.constexpr):
        """Grid (B,): the first slice holding row b's max -> its index into out[b]. PDL: wait
        for the part kernel first. ADVANCE: adv[b] += 1 (int64) as well."""
        if PDL:
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        s = tl.arange(0, BLOCK_P)
        m = s < P
        v = tl.load(pv_ptr + b * P + s, mask=m, other=float("-inf"))
        i = tl.load(pi_ptr + b * P + s, mask=m, other=2147483647)
        # slices are in order and each index is its slice's first: the first slice's index is
        # the row's first; rank the slices by position so ties go to the earliest
        _, first = _first_max(v, tl.where(m, s, 2147483647), 2147483647)
        tl.store(out_ptr + b * stride_out, tl.sum(tl.where(s == first, i, 0), axis=0).to(tl.int64))
        if ADVANCE:
            tl.store(adv_ptr + b * stride_adv, tl.load(adv_ptr + b * stride_adv) + 1)


def _default_impl(logits: torch.Tensor) -> str:
    if logits.device.type != "cuda":
        return "torch"
    return "triton" if HAVE_TRITON else "two_pass"


def pdl_capable(device: torch.device) -> bool:
    """Whether Triton kernels on `device` can launch with programmatic dependent launch: CUDA
    of compute capability 9.0 or newer (not Triton's interpreter)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and _cuda_major(torch.cuda.current_device() if device.index is None else device.index) >= 9)


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    """The compute capability's major version of CUDA device `index` (asked once: argmax runs every step)."""
    return torch.cuda.get_device_capability(index)[0]


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None, impl: str | None = None,
           advance: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """logits [B, V] -> int64 [B, 1], equal to torch.argmax(logits, -1, keepdim=True); with
    `out` ([B, 1] int64) written there as well and returned. impl: None picks by device.
    advance (int64, B entries along its first dim: [B] or [B, 1]): 1 added to each after the
    choice. pdl (the Triton impl): launch with programmatic dependent launch; None: where
    `pdl_capable`."""
    B, V = logits.shape
    impl = impl or _default_impl(logits)
    if impl not in ("torch", "two_pass", "triton"):
        raise ValueError(f"unknown argmax impl {impl!r}: torch, two_pass or triton")
    if advance is not None and (advance.dtype != torch.int64 or advance.numel() != B or advance.dim() not in (1, 2)
                                or advance.device != logits.device):
        raise ValueError(f"advance: int64 with one entry a row ([{B}] or [{B}, 1]) on the logits' device, got "
                         f"{advance.dtype} {tuple(advance.shape)} on {advance.device}")
    chunk = TRITON_CHUNK if impl == "triton" else CHUNK
    if impl == "triton" and V >= 2 * chunk and logits.stride(-1) == 1:
        P = triton.cdiv(V, chunk)
        pv = torch.empty(B, P, device=logits.device, dtype=torch.float32)
        pi = torch.empty(B, P, device=logits.device, dtype=torch.int32)
        tok = out if out is not None else torch.empty(B, 1, device=logits.device, dtype=torch.int64)
        capable = pdl_capable(logits.device)
        if pdl and not capable:
            raise ValueError(f"pdl: {logits.device} has no programmatic dependent launch (CUDA, compute capability 9.0+)")
        pdl = capable if pdl is None else bool(pdl)
        launch = {"launch_pdl": True} if pdl else {}
        _argmax_part_kernel[(P, B)](logits, pv, pi, V, logits.stride(0), P, CHUNK=chunk, PDL=pdl, num_warps=4,
                                    **launch)
        adv = advance if advance is not None else tok
        _argmax_final_kernel[(B,)](pv, pi, tok, P, tok.stride(0), adv, adv.stride(0),
                                   BLOCK_P=triton.next_power_of_2(P), PDL=pdl, ADVANCE=advance is not None,
                                   num_warps=4, **launch)
        return tok
    tok = _argmax_ops(logits, out, impl, chunk)
    if advance is not None:
        advance.add_(1)
    return tok


def _argmax_ops(logits: torch.Tensor, out: torch.Tensor | None, impl: str, chunk: int) -> torch.Tensor:
    """argmax's torch-op impls: torch.argmax itself, or the two passes over `chunk`-wide slices."""
    B, V = logits.shape
    if impl == "torch" or V < 2 * chunk or logits.stride(-1) != 1:
        return torch.argmax(logits, -1, keepdim=True, out=out)
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
