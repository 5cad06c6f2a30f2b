"""Candidate: Llama-family decode with fused projections.

prepare() concatenates q/k/v into one matrix and gate/up into another, so each layer runs
two fewer GEMMs; RoPE runs once over q and k together. Numerics: a fused GEMM may pick
another kernel than three separate ones, so this is checked, not assumed, to be exact.
"""
import torch
import torch.nn.functional as F

from engine_server.models import llama as ref
from engine_server.models.common import attention, causal_mask, lm_head_weight, rms_norm, rotate_half


def prepare(state):
    cfg, w = state.config, state.weights
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        state.scratch[f"qkv{i}"] = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        if cfg.attention_bias:
            state.scratch[f"qkv_b{i}"] = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        state.scratch[f"gu{i}"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])


def forward(state, batch):
    cfg, w, s = state.config, state.weights, state.scratch
    if cfg.is_moe or cfg.qk_norm:
        return ref.forward(state, batch)
    B, T = batch.tokens.shape
    H, KV, hd, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    x = F.embedding(batch.tokens, w["model.embed_tokens.weight"])
    cos = state.tables["rope_cos"][batch.positions].unsqueeze(2)  # [B, T, 1, hd]
    sin = state.tables["rope_sin"][batch.positions].unsqueeze(2)
    mask = causal_mask(state, batch)
    for i in state.layers:
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
        qkv = F.linear(h, s[f"qkv{i}"], s.get(f"qkv_b{i}")).view(B, T, H + 2 * KV, hd)
        qk = qkv[:, :, :H + KV]
        qk = qk * cos + rotate_half(qk) * sin  # q and k together
        q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + KV:]
        o = attention(state, i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch, mask=mask)
        x = x + F.linear(o, w[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        g, u = F.linear(h, s[f"gu{i}"]).split(I, dim=-1)
        x = x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])
    x = rms_norm(x[:, -1], w["model.norm.weight"], cfg.norm_eps)
    return F.linear(x, lm_head_weight(state))
