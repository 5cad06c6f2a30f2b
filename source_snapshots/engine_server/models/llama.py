"""Reference forward pass: Llama family (Llama 3.x, Qwen2/2.5, Mistral).

GQA, RoPE (with llama3 scaling), RMSNorm, SwiGLU MLP, optional q/k/v bias (Qwen2),
optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings. Weights use the
Hugging Face tensor names. `forward(state, batch) -> logits [B, vocab]`.

The engine packs q/k/v into one matrix and gate/up into another once, at load
(`tables` -> `state.tables["model.layers.{i}.self_attn.qkv_proj.weight"]`,
`...mlp.gate_up_proj.weight`): one GEMM instead of three, as gpt-fast stores them.

The MoE family (`moe.py`) reuses `attention_block` and `forward` with its own MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_server.models.common import apply_rope, attention, causal_mask, lm_head_weight, rms_norm


def expected_weights(cfg) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as a HF checkpoint of this config holds them."""
    D, H, KV, hd, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
            p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (H * hd,), p + "self_attn.k_proj.bias": (KV * hd,),
                       p + "self_attn.v_proj.bias": (KV * hd,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if not cfg.is_moe:
            shapes |= {p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                       p + "mlp.down_proj.weight": (D, I)}
    return shapes


def attention_block(state, layer: int, x: torch.Tensor, cos, sin, batch, mask=None) -> torch.Tensor:
    """x: [B, T, D] (already normed) -> [B, T, D]. cos/sin: [B, T, 1, hd] (sin: rope_sin_rot); mask: causal_mask."""
    cfg, w, t, p = state.config, state.weights, state.tables, f"model.layers.{layer}.self_attn."
    B, T, _ = x.shape
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = F.linear(x, t[p + "qkv_proj.weight"], t.get(p + "qkv_proj.bias")).view(B, T, H + 2 * KV, hd)
    qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
    if cfg.qk_norm:
        qk = torch.cat([rms_norm(qk[:, :, :H], w[p + "q_norm.weight"], cfg.norm_eps),
                        rms_norm(qk[:, :, H:], w[p + "k_norm.weight"], cfg.norm_eps)], dim=2)
    qk = apply_rope(qk, cos, sin)  # q and k heads together: [B, T, H+KV, hd]
    q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)  # [B, heads, T, hd]
    o = attention(state, layer, q, k, v.transpose(1, 2), batch, mask=mask)  # [B, T, H*hd]
    return F.linear(o, w[p + "o_proj.weight"])


def mlp(state, layer: int, x: torch.Tensor, batch) -> torch.Tensor:
    w, p = state.weights, f"model.layers.{layer}.mlp."
    gate, up = F.linear(x, state.tables[p + "gate_up_proj.weight"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w[p + "down_proj.weight"])


def forward(state, batch, mlp=mlp) -> torch.Tensor:
    cfg, w = state.config, state.weights
    x = F.embedding(batch.tokens, w["model.embed_tokens.weight"])  # [B, T, D]
    cos = state.tables["rope_cos"][batch.positions].unsqueeze(2)  # [B, T, 1, hd]: broadcasts over heads
    sin = state.tables["rope_sin_rot"][batch.positions].unsqueeze(2)
    mask = causal_mask(state, batch)  # once per forward, shared by the layers
    for layer in state.layers:
        p = f"model.layers.{layer}."
        x = x + attention_block(state, layer, rms_norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps),
                                cos, sin, batch, mask)
        x = x + mlp(state, layer, rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps), batch)
    x = rms_norm(x[:, -1], w["model.norm.weight"], cfg.norm_eps)  # last position only: [B, D]
    return F.linear(x, lm_head_weight(state))  # [B, vocab]


def tables(cfg, weights, max_seq: int, dtype, device) -> dict[str, torch.Tensor]:
    """RoPE cos/sin, and the packed projections (copies: the HF weights stay as they are)."""
    from engine_server.models.common import rope_tables
    out = rope_tables(cfg, max_seq, dtype, device)
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[a + "qkv_proj.weight"] = torch.cat([weights[a + n + "_proj.weight"] for n in "qkv"])
        if cfg.attention_bias:
            out[a + "qkv_proj.bias"] = torch.cat([weights[a + n + "_proj.bias"] for n in "qkv"])
        if not cfg.is_moe:
            out[m + "gate_up_proj.weight"] = torch.cat([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])
    return out
