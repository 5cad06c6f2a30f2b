"""Reference forward pass: mixture-of-experts family (Mixtral, Qwen3-MoE).

Everything but the MLP is the Llama family's (`llama.py`: embeddings, GQA attention with
RoPE, RMSNorm, Qwen3's per-head q/k RMSNorm via cfg.qk_norm, head). The MLP is sparse: a
router scores num_experts SwiGLU experts per token, each token goes to its top_k, and the
experts' outputs are summed with the routing weights. Written like the HF reference:

    probs = softmax(router logits) in float32; top_k; renormalise the top_k weights
    (Mixtral always, Qwen3-MoE iff cfg.norm_topk_prob); cast to the hidden dtype; then
    for each expert in ascending id with at least one token: SwiGLU on its tokens,
    times the routing weight, index_add_ into the output.

The accumulation order is fixed (expert id, then token), so the same inputs give bitwise
the same output. HF tensor names:

    mixtral:   model.layers.{i}.block_sparse_moe.gate.weight               [E, D]
               model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight     [I, D]  (gate)
               model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight     [I, D]  (up)
               model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight     [D, I]  (down)
    qwen3_moe: model.layers.{i}.mlp.gate.weight                            [E, D]
               model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight

with I = cfg.moe_intermediate_size. `forward(state, batch) -> logits [B, vocab]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_server.config import ConfigError
from engine_server.models import llama


def router_name(cfg, layer: int) -> str:
    if cfg.model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return f"model.layers.{layer}.mlp.gate.weight"


def expert_names(cfg, layer: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of expert e in this layer."""
    if cfg.model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def expected_weights(cfg) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape: llama's attention/norm/embedding tensors plus router and experts."""
    D, E, I, k = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    if not (0 < k <= E) or I <= 0:
        raise ConfigError(f"{cfg.model_type}: needs 0 < num_experts_per_tok <= num_experts and "
                          f"moe_intermediate_size > 0; got num_experts_per_tok={k}, "
                          f"num_experts={E}, moe_intermediate_size={I}")
    shapes = llama.expected_weights(cfg)  # omits the dense MLP since cfg.is_moe
    for i in range(cfg.num_layers):
        shapes[router_name(cfg, i)] = (E, D)
        for e in range(E):
            gate, up, down = expert_names(cfg, i, e)
            shapes |= {gate: (I, D), up: (I, D), down: (D, I)}
    return shapes


def route(cfg, router_logits: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, top_k] in `dtype`, expert ids [N, top_k] int64)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [N, k], descending
    if cfg.model_type == "mixtral" or cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def moe_mlp(state, layer: int, x: torch.Tensor, batch) -> torch.Tensor:
    """x: [B, T, D] (already normed) -> [B, T, D]."""
    cfg, w = state.config, state.weights
    B, T, D = x.shape
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    x = x.reshape(B * T, D)  # [N, D]: one row per token
    weights, experts = route(cfg, F.linear(x, w[router_name(cfg, layer)]), x.dtype)  # [N, k] each
    if batch.expert_log is not None:
        batch.expert_log.append(experts.to("cpu", torch.int64))

    # Group the N*k (token, expert) assignments by expert. The sort is stable, so each
    # expert's tokens stay in ascending order; a token picks an expert at most once.
    flat = experts.flatten()  # [N*k]; assignment j is token j // k
    order = torch.argsort(flat, stable=True)  # [N*k]
    token_of = order // k  # [N*k] token of each assignment, grouped by expert
    weight_of = weights.flatten()[order]  # [N*k]
    counts = torch.bincount(flat, minlength=E).tolist()  # tokens per expert: the one host sync

    out = torch.zeros_like(x)  # [N, D]
    start = 0
    for e in range(E):  # ascending expert id: a fixed order of accumulation
        n = counts[e]
        if n == 0:
            continue
        tok = token_of[start:start + n]  # [n]
        gate, up, down = expert_names(cfg, layer, e)
        h = x[tok]  # [n, D]
        y = F.linear(F.silu(F.linear(h, w[gate])) * F.linear(h, w[up]), w[down])  # [n, D]
        out.index_add_(0, tok, y * weight_of[start:start + n, None])
        start += n
    return out.view(B, T, D)


def forward(state, batch) -> torch.Tensor:
    return llama.forward(state, batch, mlp=moe_mlp)


def tables(cfg, weights, max_seq: int, dtype, device) -> dict[str, torch.Tensor]:
    return llama.tables(cfg, weights, max_seq, dtype, device)


def experts_active(expert_log: list) -> dict:
    """Summary of one forward call's routing log (`batch.expert_log`, one [N, top_k] entry per
    MoE layer run): distinct experts each layer ran, their mean over layers, and the total
    (layer, expert) pairs, i.e. the expert weight sets the step had to read."""
    per_layer = [int(torch.unique(ids).numel()) for ids in expert_log]
    return {
        "layers": len(per_layer),
        "per_layer": per_layer,
        "mean_per_layer": sum(per_layer) / len(per_layer) if per_layer else 0.0,
        "total": sum(per_layer),
    }
