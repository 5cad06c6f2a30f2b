"""Baselines the engine's forward passes are compared with, at batch 1, in the same process.

- `Decoder` + `compiled_decode_rate`: a compact Llama decoder in the style of gpt-fast,
  written here from scratch: one nn.Module, fused QKV projection, RoPE tables with the
  config's scaling (llama3 included), grouped-query attention through
  `scaled_dot_product_attention` over a static KV cache ([1, KV, max_seq, head_dim], written
  with `index_copy_`), and its decode step compiled with
  `torch.compile(mode="reduce-overhead", fullgraph=True)` (Inductor kernels replayed in CUDA
  graphs). The cache holds prompt + generated tokens, as a gpt-fast user sizes it.
- `hf_decode_rate`: Hugging Face transformers, what a user runs by default:
  `LlamaForCausalLM(LlamaConfig(...))` in bf16 and `model.generate(do_sample=False)` with
  its default cache.

Both take the engine's config (`engine_server.config`) and either random weights or the
engine's own `{hf_name: tensor}` dict (copied, so a baseline owns its memory), and return
a `BaselineResult`: decode tokens/s at batch 1 after a prompt of `context` tokens, the
greedy tokens, compile seconds and peak memory. They run on the CPU with a shrunk config
(the tests) and on CUDA with the real one.

    python benchmarks/baselines.py --model llama-3.2-1b --device cuda --context 512
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_server.config import ModelConfig, parse_dtype, resolve_model, shrink  # noqa: E402
from engine_server.models.common import rope_tables  # noqa: E402


@dataclass
class BaselineResult:
    name: str
    ok: bool = True
    tok_s: float = 0.0  # decode tokens/s at batch 1 (median over repeats)
    us_per_token: float = 0.0
    context: int = 0  # prompt tokens before the first timed step
    steps: int = 0  # decode steps per timed repeat
    repeats: int = 0
    compile_s: float | None = None
    # CUDA: torch.cuda.max_memory_allocated from the built model to the last step (weights, cache,
    # compile and CUDA-graph pools, activations), minus what was allocated before the baseline
    peak_bytes: int | None = None
    weight_bytes: int = 0
    tokens: list[int] = field(default_factory=list)  # greedy tokens of the first repeat
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---- a gpt-fast-style decoder ---------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the Hugging Face layout (halves, not interleaved pairs), so HF weights load as they are."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq: int):
        super().__init__()
        D, H, KV, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.KV, self.hd = H, KV, hd
        self.wqkv = nn.Linear(D, (H + 2 * KV) * hd, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * hd, D, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, KV, max_seq, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, KV, max_seq, hd), persistent=False)

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        H, KV, hd = self.H, self.KV, self.hd
        q, k, v = self.wqkv(x).split([H * hd, KV * hd, KV * hd], dim=-1)
        q = _rotate(q.view(B, T, H, hd).transpose(1, 2), cos, sin)  # [B, H, T, hd]
        k = _rotate(k.view(B, T, KV, hd).transpose(1, 2), cos, sin)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        keys = self.k_cache.repeat_interleave(H // KV, dim=1)  # GQA: each KV head serves H/KV query heads
        vals = self.v_cache.repeat_interleave(H // KV, dim=1)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * hd))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, max_seq)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """A dense Llama-family decoder (Llama, Qwen2, Mistral without sliding window) with a
    static batch-1 KV cache of `max_seq` positions. forward(idx [1, T], input_pos [T]) ->
    logits of the last position [1, vocab]."""

    def __init__(self, cfg: ModelConfig, max_seq: int):
        super().__init__()
        if cfg.family != "llama" or cfg.qk_norm or cfg.is_moe or cfg.hidden_act != "silu":
            raise ValueError(f"the baseline decoder covers dense Llama-family models, not {cfg.model_type}")
        self.cfg, self.max_seq = cfg, max_seq
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, max_seq) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("causal", torch.ones(max_seq, max_seq, dtype=torch.bool).tril(), persistent=False)
        self.register_buffer("cos", torch.zeros(max_seq, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.zeros(max_seq, cfg.head_dim), persistent=False)

    def setup(self, dtype, device) -> "Decoder":
        """Move to dtype/device and fill the RoPE tables (llama3/linear scaling as configured)."""
        self.to(device=device, dtype=dtype)
        t = rope_tables(self.cfg, self.max_seq, dtype, device)
        self.cos.copy_(t["rope_cos"])
        self.sin.copy_(t["rope_sin"])
        self.causal.copy_(torch.ones(self.max_seq, self.max_seq, dtype=torch.bool, device=device).tril())
        return self

    def reset_cache(self) -> None:
        for layer in self.layers:
            layer.attention.k_cache.zero_()
            layer.attention.v_cache.zero_()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        cos, sin = self.cos[input_pos], self.sin[input_pos]  # [T, hd]: broadcasts over batch and heads
        mask = self.causal[None, None, input_pos]  # [1, 1, T, max_seq]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x[:, -1]))

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "Decoder":
        """Random weights drawn on the module's device: N(0, 1/sqrt(fan_in)) matrices, unit norms."""
        g = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.normal_(0.0, 0.5 if "tok_embeddings" in name else 1.0 / math.sqrt(p.shape[-1]), generator=g)
        return self

    @torch.no_grad()
    def load_hf(self, weights: dict[str, torch.Tensor]) -> "Decoder":
        """Copy weights named as a HF checkpoint names them (the engine's `state.weights`)."""
        for i, layer in enumerate(self.layers):
            p, a, f = f"model.layers.{i}.", layer.attention, layer.feed_forward
            a.wqkv.weight.copy_(torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            if self.cfg.attention_bias:
                a.wqkv.bias.copy_(torch.cat([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
            a.wo.weight.copy_(weights[p + "self_attn.o_proj.weight"])
            f.w1.weight.copy_(weights[p + "mlp.gate_proj.weight"])
            f.w3.weight.copy_(weights[p + "mlp.up_proj.weight"])
            f.w2.weight.copy_(weights[p + "mlp.down_proj.weight"])
            layer.attention_norm.weight.copy_(weights[p + "input_layernorm.weight"])
            layer.ffn_norm.weight.copy_(weights[p + "post_attention_layernorm.weight"])
        self.tok_embeddings.weight.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        if not self.cfg.tie_word_embeddings:
            self.output.weight.copy_(weights["lm_head.weight"])
        return self


def _cache_len(context: int, steps: int, warmup: int) -> int:
    n = context + steps + warmup + 1
    return (n + 63) // 64 * 64  # sized to the generation, as gpt-fast sizes it, rounded up


class _default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _weight_bytes(module: nn.Module) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel() * p.element_size()
    return n


def _prompt(cfg: ModelConfig, context: int, prompt: list[int] | None, seed: int) -> list[int]:
    if prompt is not None:
        if len(prompt) < context:
            raise ValueError(f"prompt has {len(prompt)} tokens, context {context}")
        return list(prompt[:context])
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def compiled_decode_rate(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, context: int = 512,
                         steps: int = 256, warmup: int = 16, repeats: int = 3,
                         weights: dict[str, torch.Tensor] | None = None, prompt: list[int] | None = None,
                         mode: str | None = "reduce-overhead", coordinate_descent: bool = False,
                         seed: int = 0) -> BaselineResult:
    """Batch-1 greedy decode tokens/s of the gpt-fast-style decoder after a `context`-token
    prompt (prefilled eagerly). mode=None runs the decode step eagerly (CPU tests); otherwise
    it is `torch.compile(step, mode=mode, fullgraph=True)`. Each repeat restarts from the
    same prompt state and times `steps` decode steps (CUDA events on CUDA), each one a
    compiled step (logits and argmax) plus the position increment outside it."""
    device = torch.device(device)
    name = "gpt-fast-style " + (f"torch.compile({mode})" if mode else "eager")
    res = BaselineResult(name=name, context=context, steps=steps, repeats=repeats)
    try:
        _free(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        max_seq = _cache_len(context, steps, warmup)
        with torch.device("meta"), _default_dtype(dtype):  # no float32 copy of the weights, ever
            model = Decoder(cfg, max_seq)
        model = model.to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.output.weight = model.tok_embeddings.weight
        model.setup(dtype, device).eval()
        model.load_hf(weights) if weights is not None else model.init_random(seed)
        res.weight_bytes = _weight_bytes(model)
        ids = torch.tensor([_prompt(cfg, context, prompt, seed)], device=device)

        def step(m, tok, input_pos):
            logits = m(tok, input_pos)
            return logits.argmax(-1, keepdim=True)  # [1, 1]: the next input

        if mode:
            import torch._inductor.config as inductor_config
            from torch._dynamo.utils import counters
            cdt_before = inductor_config.coordinate_descent_tuning
            inductor_config.coordinate_descent_tuning = coordinate_descent
            counters.clear()
            for layer in model.layers:  # the static cache: fixed addresses, mutated inside the graph
                torch._dynamo.mark_static_address(layer.attention.k_cache)
                torch._dynamo.mark_static_address(layer.attention.v_cache)
            step_fn = torch.compile(step, mode=mode, fullgraph=True)
            res.notes.append(f"torch.compile(mode={mode!r}, fullgraph=True), "
                             f"coordinate_descent_tuning={coordinate_descent}")
        else:
            step_fn = step
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
        mark = mark if (mode and device.type == "cuda" and mark is not None) else None
        res.notes.append(f"static KV cache of {max_seq} positions, SDPA with a boolean mask")

        with torch.no_grad():
            model.reset_cache()
            first = model(ids, torch.arange(context, device=device)).argmax(-1, keepdim=True)
            pos = torch.tensor([context], device=device)

            def run(n: int, record: list | None = None) -> torch.Tensor:
                tok = first
                pos.fill_(context)
                for _ in range(n):
                    if mark is not None:
                        mark()  # a new decode step: the previous step's outputs may be overwritten
                    tok = step_fn(model, tok, pos).clone()
                    if record is not None:
                        record.append(tok)
                    pos.add_(1)
                return tok

            t = time.perf_counter()
            run(min(3, warmup))  # compiles (and records the CUDA graph) on the first calls
            _sync(device)
            res.compile_s = round(time.perf_counter() - t, 2)
            run(warmup)
            times = []
            for r in range(repeats):
                rec: list | None = [] if r == 0 else None
                _sync(device)
                if device.type == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    run(steps, rec)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 1e3)
                else:
                    t = time.perf_counter()
                    run(steps, rec)
                    times.append(time.perf_counter() - t)
                if rec is not None:
                    res.tokens = [int(first.item())] + [int(x.item()) for x in rec]
        sec = statistics.median(times) / steps
        res.tok_s, res.us_per_token = round(1 / sec, 1), round(sec * 1e6, 1)
        if mode:
            skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
            if device.type == "cuda":
                res.notes.append("CUDA graphs skipped (see the inductor log)" if skips else
                                 "decode step replayed in CUDA graphs")
        if device.type == "cuda":
            res.peak_bytes = torch.cuda.max_memory_allocated(device) - before
    except Exception as e:  # noqa: BLE001 - a failing baseline is a row, not a crash
        res.ok, res.error = False, f"{type(e).__name__}: {str(e)[:1500]}"
    finally:
        model = step_fn = None  # noqa: F841
        if mode:
            try:
                torch._dynamo.reset()  # frees the compiled step and its CUDA-graph trees
                inductor_config.coordinate_descent_tuning = cdt_before
            except Exception:  # noqa: BLE001
                pass
        _free(device)
    return res


# ---- Hugging Face transformers --------------------------------------------------------


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The model's HF config.json, with the fields `shrink` changed set to the shrunk values."""
    d = copy.deepcopy(cfg.raw) if cfg.raw else {"model_type": cfg.model_type}
    d.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
             max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
             rope_scaling=copy.deepcopy(cfg.rope_scaling), rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
             bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    for k in ("_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)
    return d


def hf_model(cfg: ModelConfig, device, dtype, weights: dict[str, torch.Tensor] | None = None, seed: int = 0):
    """LlamaForCausalLM (or the family's class) built from the config, random or the given weights."""
    import transformers
    d = hf_config_dict(cfg)
    cls_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cls_cfg)
    model = model.to(device=device, dtype=dtype).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(dict(weights), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)
                   and "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the HF model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if cfg.tie_word_embeddings:
            model.tie_weights()
    return model


def hf_decode_rate(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, context: int = 512, steps: int = 256,
                   repeats: int = 3, weights: dict[str, torch.Tensor] | None = None,
                   prompt: list[int] | None = None, seed: int = 0) -> BaselineResult:
    """Batch-1 greedy decode tokens/s of `model.generate(do_sample=False)` with its default
    cache: (steps) / (time to generate steps+1 tokens - time to generate 1 token), so the
    prefill of the prompt is left out; medians over `repeats`."""
    device = torch.device(device)
    res = BaselineResult(name="HF transformers generate", context=context, steps=steps, repeats=repeats)
    model = None
    try:
        import transformers
        _free(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = hf_model(cfg, device, dtype, weights, seed)
        res.weight_bytes = _weight_bytes(model)
        if device.type == "cuda":  # building the model may pass through float32: not what it runs in
            _free(device)
            torch.cuda.reset_peak_memory_stats(device)
        gc_ = model.generation_config
        gc_.eos_token_id = None  # random weights: never stop early
        gc_.pad_token_id = 0
        ids = torch.tensor([_prompt(cfg, context, prompt, seed)], device=device)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True, **kw)
            cache = getattr(out, "cache", None)
            cache = type(cache if cache is not None else getattr(out, "past_key_values", None)).__name__
            res.notes.append(f"transformers {transformers.__version__}, generate(do_sample=False), default cache "
                             f"({cache}), attention {getattr(model.config, '_attn_implementation', '?')}")

            def timed(n: int) -> tuple[float, torch.Tensor]:
                _sync(device)
                t = time.perf_counter()
                o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                _sync(device)
                return time.perf_counter() - t, o

            one, many = [], []
            for r in range(repeats):
                one.append(timed(1)[0])
                t, o = timed(steps + 1)
                many.append(t)
                if r == 0:
                    res.tokens = o[0, context:].tolist()
        sec = max(1e-9, statistics.median(many) - statistics.median(one)) / steps
        res.tok_s, res.us_per_token = round(1 / sec, 1), round(sec * 1e6, 1)
        if device.type == "cuda":
            res.peak_bytes = torch.cuda.max_memory_allocated(device) - before
    except Exception as e:  # noqa: BLE001
        res.ok, res.error = False, f"{type(e).__name__}: {str(e)[:1500]}"
    finally:
        model = None
        _free(device)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="")
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--compile-mode", default="reduce-overhead", help="'none' runs the decoder eagerly")
    p.add_argument("--skip-hf", action="store_true")
    a = p.parse_args()
    cfg, _ = resolve_model(a.model)
    cfg = shrink(cfg) if a.shrink else cfg
    dtype = parse_dtype(a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    mode = None if a.compile_mode == "none" else a.compile_mode
    rows = [compiled_decode_rate(cfg, a.device, dtype, a.context, a.steps, mode=mode)]
    if not a.skip_hf:
        rows.append(hf_decode_rate(cfg, a.device, dtype, a.context, a.steps))
    for r in rows:
        print(f"{r.name}: {r.tok_s} tok/s ({r.us_per_token} us/token), compile {r.compile_s} s, "
              f"peak {r.peak_bytes}, {r.error or ''}")
    print(json.dumps({"bench": "baselines", "rows": [r.to_dict() | {"tokens": r.tokens[:16]} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
