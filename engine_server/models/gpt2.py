"""Reference forward pass: GPT-2.

Learned absolute position embeddings, LayerNorm (weight and bias), multi-head attention
(num_kv_heads == num_heads) over the same static KV cache as every family, a GELU MLP
("gelu_new" = the tanh approximation), LM head tied to the token embedding. Weights use the
Hugging Face names of GPT2LMHeadModel, with the "transformer." prefix (`weights.py` adds it
for checkpoints that store bare `h.0...` names). No RoPE: `tables` is empty.

The projections are HF `Conv1D`: the weight is stored [in, out], transposed relative to
nn.Linear, and y = x @ W + b. `forward(state, batch) -> logits [B, vocab]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_server.config import ConfigError
from engine_server.models.common import attention, causal_mask

# cfg.hidden_act -> activation; HF's "gelu_new" and "gelu_pytorch_tanh" are both the tanh form
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def activation(cfg):
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"gpt2: unsupported activation_function {cfg.hidden_act!r}; "
                          f"supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[cfg.hidden_act]


def expected_weights(cfg) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as a HF checkpoint of this config holds them."""
    D, I, H, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    if H * hd != D or cfg.num_kv_heads != H:
        raise ConfigError(f"gpt2: needs hidden_size == num_heads * head_dim and num_kv_heads == "
                          f"num_heads; got hidden_size={D}, num_heads={H}, head_dim={hd}, "
                          f"num_kv_heads={cfg.num_kv_heads}")
    activation(cfg)  # an unsupported activation fails here, at load, not at the first forward
    shapes = {"transformer.wte.weight": (cfg.vocab_size, D),
              "transformer.wpe.weight": (cfg.max_position_embeddings, D),
              "transformer.ln_f.weight": (D,), "transformer.ln_f.bias": (D,)}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (D,), p + "ln_1.bias": (D,),
            p + "attn.c_attn.weight": (D, 3 * D), p + "attn.c_attn.bias": (3 * D,),
            p + "attn.c_proj.weight": (D, D), p + "attn.c_proj.bias": (D,),
            p + "ln_2.weight": (D,), p + "ln_2.bias": (D,),
            p + "mlp.c_fc.weight": (D, I), p + "mlp.c_fc.bias": (I,),
            p + "mlp.c_proj.weight": (I, D), p + "mlp.c_proj.bias": (D,),
        }
    return shapes


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """HF Conv1D: weight [in, out], y = x @ W + b (as HF computes it: one addmm). x: [..., in]."""
    y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)  # [N, out]
    return y.view(*x.shape[:-1], weight.shape[-1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def attention_block(state, layer: int, x: torch.Tensor, batch, mask=None) -> torch.Tensor:
    """x: [B, T, D] (already normed) -> [B, T, D]. mask: common.causal_mask(state, batch)."""
    cfg, w, p = state.config, state.weights, f"transformer.h.{layer}.attn."
    B, T, D = x.shape
    H, hd = cfg.num_heads, cfg.head_dim
    qkv = conv1d(x, w[p + "c_attn.weight"], w[p + "c_attn.bias"])  # [B, T, 3D]
    q, k, v = qkv.split(D, dim=-1)  # each [B, T, D]
    q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
    k = k.view(B, T, H, hd).transpose(1, 2)
    v = v.view(B, T, H, hd).transpose(1, 2)
    o = attention(state, layer, q, k, v, batch, mask=mask)  # [B, T, D]; scale 1/sqrt(hd), as GPT-2
    return conv1d(o, w[p + "c_proj.weight"], w[p + "c_proj.bias"])


def mlp(state, layer: int, x: torch.Tensor, batch) -> torch.Tensor:
    w, p = state.weights, f"transformer.h.{layer}.mlp."
    h = activation(state.config)(conv1d(x, w[p + "c_fc.weight"], w[p + "c_fc.bias"]))  # [B, T, I]
    return conv1d(h, w[p + "c_proj.weight"], w[p + "c_proj.bias"])  # [B, T, D]


def forward(state, batch, mlp=mlp) -> torch.Tensor:
    cfg, w, eps = state.config, state.weights, state.config.norm_eps
    x = (F.embedding(batch.tokens, w["transformer.wte.weight"])  # [B, T, D]
         + F.embedding(batch.positions, w["transformer.wpe.weight"]))  # learned absolute positions
    mask = causal_mask(state, batch)  # once per forward, shared by the layers
    for layer in state.layers:
        p = f"transformer.h.{layer}."
        x = x + attention_block(state, layer, layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps),
                                batch, mask)
        x = x + mlp(state, layer, layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps), batch)
    x = layer_norm(x[:, -1], w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)  # last position: [B, D]
    return F.linear(x, w["transformer.wte.weight"])  # tied head: [B, vocab]


def tables(cfg, weights, max_seq: int, dtype, device) -> dict[str, torch.Tensor]:
    return {}  # positions are learned (transformer.wpe), nothing to derive
