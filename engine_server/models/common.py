"""Pieces the reference forward passes share: norms, RoPE, attention over the static cache.

Everything here is plain PyTorch, written to be read. Candidates may import and call these
for the parts they leave alone. Shapes: B rows, T query tokens per row, H query heads,
KV key/value heads, D head dim, S = max_seq of the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine_server.config import ConfigError, ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused kernel on CUDA, accumulating in float32 (HF scales after rounding to the
    # input dtype; this rounds once, at the end)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if kind == "default":
        return base
    if kind == "linear":
        return base / rs["factor"]
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"unsupported rope_scaling type {kind!r}")


def rope_tables(cfg: ModelConfig, max_seq: int, dtype, device) -> dict[str, torch.Tensor]:
    """cos/sin: [max_seq, D] in the model dtype (computed in float32 first, as HF does)."""
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq(cfg))
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    half = cfg.head_dim // 2
    sin_rot = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # the sign rotate_half would apply
    return {"rope_cos": emb.cos().to(dtype).to(device), "rope_sin": sin.to(dtype).to(device),
            "rope_sin_rot": sin_rot.to(dtype).to(device)}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, in one kernel fewer: rotate_half(x) is
    roll(x, D/2) with the first half negated, and that sign lives in `sin_rot` instead
    ((-a) * b == a * (-b) exactly). x: [..., D]; cos/sin_rot broadcast against it."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_rot


def write_kv(state, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
    """Store this step's K/V in the batch's own cache cells. k, v: [B, KV, T, D]."""
    rows = batch.slots[:, None]  # [B, 1] broadcasts against positions [B, T]
    state.k_cache[layer][rows, :, batch.positions] = k.transpose(1, 2)  # cells: [B, T, KV, D]
    state.v_cache[layer][rows, :, batch.positions] = v.transpose(1, 2)


def causal_mask(state, batch) -> torch.Tensor:
    """[B, 1, T, S] bool: query t of row b may see cache position s <= positions[b, t]."""
    S = state.max_seq
    return (torch.arange(S, device=batch.positions.device)[None, None, :] <= batch.positions[:, :, None])[:, None]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots], copied as 8-byte words: the same bits with a quarter of the loads of a
    bf16 copy. cache: [num_slots, KV, S, D] -> [B, KV, S, D]."""
    if (cache.shape[-1] * cache.element_size()) % 8:
        return cache.index_select(0, slots)
    return cache.view(torch.int64).index_select(0, slots).view(cache.dtype)


def attention(state, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch,
              scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q over the row's cache slot, after writing k/v into it.

    q: [B, H, T, D]; k, v: [B, KV, T, D] -> [B, T, H*D]. Reads the whole slot (static shape,
    graph-capturable) and masks keys past each query's position, so whatever sits in the
    unused cells (the exactness check fills them with noise) cannot change the result.
    `mask` is causal_mask(state, batch), computed once per forward by the caller.

    Written out as HF's eager attention (bf16 matmuls, float32 softmax) rather than a fused
    kernel: it is deterministic, and the G query heads of a group share their KV head
    without copying it (GQA).
    """
    write_kv(state, layer, k, v, batch)
    keys = gather_slots(state.k_cache[layer], batch.slots)  # [B, KV, S, D]
    vals = gather_slots(state.v_cache[layer], batch.slots)
    if mask is None:
        mask = causal_mask(state, batch)
    B, H, T, D = q.shape
    KV, S = keys.shape[1], keys.shape[2]
    G = H // KV
    qg = q.reshape(B, KV, G * T, D)  # query head h = kv * G + g uses kv head h // G
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (scale if scale is not None else D ** -0.5)
    scores = scores.view(B, KV, G, T, S).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(B, KV, G * T, S)
    out = torch.matmul(probs, vals)  # [B, KV, G*T, D]
    return out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)


def lm_head_weight(state) -> torch.Tensor:
    w = state.weights
    return w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
