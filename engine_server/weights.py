"""Weights: load a local HF model directory (safetensors, sharded or not), or initialise
deterministically from a seed. Never a model hub.

Both paths produce the same thing: `{hf_name: tensor}` in the engine's dtype on its device,
checked against the family's `expected_weights(cfg)`. A missing, unexpected or misshapen
tensor is a `WeightsError` naming it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine_server.config import ModelConfig
from engine_server.models import family

INDEX = "model.safetensors.index.json"


class WeightsError(ValueError):
    """The weights on disk do not fit the config; the message names the tensor and the file."""


def init_weights(cfg: ModelConfig, seed: int = 0, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    """Deterministic random weights: same (config, seed) -> same values on any machine.

    Generated in float32 on the CPU, tensor by tensor in sorted-name order, then cast.
    Norm weights are 1 (LayerNorm biases 0); matrices ~ N(0, 1/sqrt(fan_in)) so activations
    keep a sane scale through the layers.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(family(cfg).expected_weights(cfg).items()):
        if _is_norm(name):
            t = torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape)
        elif len(shape) == 1:
            t = torch.randn(shape, generator=g) * 0.02
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
            if "embed" in name or name.endswith("wte.weight") or name.endswith("wpe.weight"):
                t = t * math.sqrt(fan_in) * 0.02 * 25  # embeddings: O(0.5) entries
        out[name] = t.to(dtype=dtype, device=device)
    return out


def _is_norm(name: str) -> bool:
    return any(k in name for k in ("norm", "ln_", ".ln_f"))


def load_weights(model_dir: Path, cfg: ModelConfig, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    """Read a HF directory: `model.safetensors`, or shards listed in `model.safetensors.index.json`."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{model_dir}: no model.safetensors or {INDEX}")
    expected = family(cfg).expected_weights(cfg)
    out = {}
    for fname in files:
        path = model_dir / fname
        if not path.exists():
            raise WeightsError(f"{path}: shard named in {INDEX} is missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors' own error types: a file it cannot parse
            raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                key = _canonical(name, cfg)
                if cfg.model_type == "gpt2" and key.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # GPT-2's causal-mask buffers, stored by older checkpoints: not weights
                if key not in expected:
                    if cfg.tie_word_embeddings and key == "lm_head.weight":
                        continue  # some tied checkpoints still store the head
                    raise WeightsError(f"{path}: unexpected tensor {name!r} for {cfg.model_type}")
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(expected[key]):
                    raise WeightsError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                       f"expected {tuple(expected[key])}")
                if not t.is_floating_point():
                    raise WeightsError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected floating point")
                # copy=True: an owned, allocator-aligned tensor. Tensors read from a file sit at
                # the file's byte offsets, and CPU GEMMs round differently on misaligned
                # data, so without the copy logits would depend on where a tensor sat on disk.
                out[key] = t.to(dtype=dtype, device=device, copy=True)
    missing = sorted(set(expected) - set(out))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{model_dir}: missing tensors {missing[:5]}{more}")
    return out


def _canonical(name: str, cfg: ModelConfig) -> str:
    # GPT-2 checkpoints store names without the "transformer." prefix
    if cfg.model_type == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def save_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, model_dir: Path,
                 max_shard_bytes: int | None = None) -> None:
    """Write a HF-style directory (config.json + safetensors, sharded with an index when
    `max_shard_bytes` is given and exceeded)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
    tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    if max_shard_bytes is None or sum(t.numel() * t.element_size() for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in shard}
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def to_hf_config(cfg: ModelConfig) -> dict:
    """A HF config.json dict that `config.from_hf_dict` maps back onto `cfg`."""
    if cfg.model_type == "gpt2":
        return {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size,
                "n_head": cfg.num_heads, "n_layer": cfg.num_layers, "n_inner": cfg.intermediate_size,
                "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": cfg.hidden_act, "bos_token_id": cfg.bos_token_id,
                "eos_token_id": cfg.eos_token_id}
    d = {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
         "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
         "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
         "hidden_act": cfg.hidden_act, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if cfg.model_type == "mixtral":
        # Mixtral has one width, intermediate_size, and it is the experts' (shrink() may leave
        # the unused dense intermediate_size different from moe_intermediate_size)
        d |= {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
              "intermediate_size": cfg.moe_intermediate_size}
    if cfg.model_type == "qwen3_moe":
        d |= {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
              "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    return d
