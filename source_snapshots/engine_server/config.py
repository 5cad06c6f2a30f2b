"""Configuration: `ModelConfig` (built from a real Hugging Face `config.json`) and
`EngineConfig` (every field a flag of `tkcc engine ...`).

Presets are the real config files in `engine_server/presets/` (see ATTRIBUTION.md there).
`--model` takes a preset name, a path to a `config.json`, or a local HF model directory.
`shrink()` scales a real config down for the CPU while keeping what makes the
architecture itself: GQA ratio, MoE top-k, biases, norms, tying, RoPE scaling kind.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESETS_DIR = Path(__file__).parent / "presets"

# model_type -> family module under engine_server/models/
FAMILIES = {
    "llama": "llama",
    "qwen2": "llama",
    "mistral": "llama",
    "mixtral": "moe",
    "qwen3_moe": "moe",
    "gpt2": "gpt2",
}

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class ConfigError(ValueError):
    """A model config or model directory the engine cannot use; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str = "silu"
    # MoE (0 experts = dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    source: str = ""  # where the config came from
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d


@dataclass
class EngineConfig:
    """Every field is a CLI flag of `tkcc engine ...` (underscores become dashes).
    Zero means "pick for the device" (CPU values keep a tiny model's calls to seconds)."""
    model: str = "llama-3.2-1b"  # a preset (engine_server/presets), a config.json, or a local HF model directory
    shrink: bool = False  # a CPU-sized copy of the model's config, same architecture (random weights)
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = ""  # default: bfloat16 on CUDA, float32 on the CPU
    seed: int = 0  # random weights' seed (when the model brings none)
    traffic: str = ""  # trace file; default: the packaged Azure LLM code trace
    max_batch: int = 8
    max_seq: int = 0  # KV cache positions per slot (CPU 512, CUDA 4096)
    fast_fraction: float = 0.2  # share of layers the fast tier runs (1: full depth, nothing extrapolated)
    fast_min_layers: int = 0  # ... and at least this many (CPU 1, CUDA 2). On CUDA, where kernels overlap
    # (PDL's early launches), a lone layer's time is a poor slope: on the 4-layer shrunk preset the
    # Triton examples' full-depth steps ran 0.97-1.25x the extrapolation from one layer (the depth
    # check's slack is 1.25), 1.00-1.10x from two, the depth padder 2.94-3.21x and 1.41x (H100:
    # benchmarks/results/h100_depth_check_shrunk_fast_layers.json); 16-layer presets run three either way
    fast_contexts: int = 2  # context-length quantiles sampled by the fast tier
    fast_rounds: int = 0  # timed A/B rounds, at most (CPU 21, CUDA 15)
    fast_min_rounds: int = 0  # rounds before the fast tier may stop early on fast_ci (CPU 9, CUDA 5)
    fast_ci: float = 0.0  # stop once the speedup's 95% CI is within +-this share of it (CPU 0.05, CUDA 0.01; < 0: off)
    fast_iters: int = 0  # steps per timing of the heaviest decode shape (CPU 3, CUDA 10; lighter ones fewer)
    fast_prefill: str = "layers"  # "layers": the prefill timed at the fast layers and at none,
    # extrapolated as the decode shapes are (and depth-checked); "full": timed at full depth
    # (H200: Spearman 0.986 against the full tier with "layers", 0.994 with "full", 0.90 s a
    # call against 1.16 s: benchmarks/results/h200_fidelity_llama-3.2-1b.json)
    warmup_rounds: int = -1  # fast-tier rounds dropped (-1: CPU 1, CUDA 2). CPU: a new pass's first
    # round is slow (each shape's first call), the second is not (`round_noise_bench.py --set
    # '{"warmup_rounds": 0}'`, benchmarks/results/cpu_round_noise_warmup0_llama-3.2-1b-shrunk.json)
    full_requests: int = 0  # trace requests replayed by the full tier (CPU 10, CUDA 32)
    full_max_prompt: int = 0  # cap on prompt tokens (CPU 64, CUDA 2048)
    full_max_output: int = 0  # cap on output tokens (CPU 8, CUDA 64)
    full_reps: int = 4  # timed replays per side, after one warm-up each (even: orders balance)
    trace_speed: float = 1.0  # arrivals compressed by this factor in the full tier
    exact_rows: int = 4  # rows the exactness check prefills and decodes together
    exact_steps: int = 8  # greedy decode steps the exactness check compares
    exact_max_prompt: int = 0  # cap on its prompts' tokens (CPU 48, CUDA 512)
    noise_scale: float = 100.0  # unused KV cells hold N(0, noise_scale) in exactness checks
    prepare_budget_mb: float = 0.0  # default: the weights' size + 256 MiB
    call_timeout_s: float = 600.0  # per call, in-process: ends Python-level hangs without a restart
    worker_grace_s: float = 30.0  # the server kills the worker at call_timeout_s + this
    implausible_speedup: float = 50.0  # flagged when above, even if the checks pass
    capture_graphs: bool = True  # CUDA: each candidate's decode steps captured as CUDA graphs
    cpu_threads: int = 1  # torch threads on the CPU (0: torch's default); tiny models gain nothing from more
    cpu_keep_heap: bool = True  # CPU: the process's freed memory stays in its heap and large blocks come from
    # it (glibc mallopt: engine_server.heap), so a step's temporaries stop page-faulting afresh every step

    def resolved(self) -> "EngineConfig":
        from engine_server.traffic import DEFAULT_TRACE
        if self.fast_prefill not in ("full", "layers"):
            raise ConfigError(f"fast_prefill {self.fast_prefill!r}: use 'full' or 'layers'")
        cuda = self.device.startswith("cuda")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch {self.max_batch}: at least 1")
        pick = lambda v, c, g: v or (g if cuda else c)  # noqa: E731
        return dataclasses.replace(
            self, dtype=self.dtype or ("bfloat16" if cuda else "float32"),
            max_seq=pick(self.max_seq, 512, 4096), fast_rounds=pick(self.fast_rounds, 21, 15),
            fast_min_rounds=pick(self.fast_min_rounds, 9, 5), fast_ci=pick(self.fast_ci, 0.05, 0.01),
            fast_iters=pick(self.fast_iters, 3, 10), fast_min_layers=pick(self.fast_min_layers, 1, 2),
            warmup_rounds=self.warmup_rounds if self.warmup_rounds >= 0 else (2 if cuda else 1),
            fast_prefill=self.fast_prefill,
            full_requests=pick(self.full_requests, 10, 32),
            full_max_prompt=pick(self.full_max_prompt, 64, 2048),
            full_max_output=pick(self.full_max_output, 8, 64),
            exact_max_prompt=pick(self.exact_max_prompt, 48, 512),
            traffic=self.traffic or str(DEFAULT_TRACE))


def check_device(device: str) -> None:
    """ConfigError unless this machine has `device` ("cpu", "cuda", "cuda:N")."""
    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r}: {e}") from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def from_hf_dict(d: dict[str, Any], name: str = "", source: str = "") -> ModelConfig:
    """Map a HF config dict onto ModelConfig. Unsupported model_type is a ConfigError."""
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(
            f"unsupported model_type {mt!r} in {source or 'config'}; supported: {sorted(FAMILIES)}")
    try:
        if mt == "gpt2":
            hidden = d["n_embd"]
            heads = d["n_head"]
            return ModelConfig(
                model_type=mt, vocab_size=d["vocab_size"], hidden_size=hidden,
                intermediate_size=d.get("n_inner") or 4 * hidden, num_layers=d["n_layer"],
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                max_position_embeddings=d["n_positions"], norm_eps=d.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=True, attention_bias=True,
                hidden_act=d.get("activation_function", "gelu_new"),
                bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                name=name, source=source, raw=d)
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        moe = mt in ("mixtral", "qwen3_moe")
        if mt == "qwen3_moe" and (d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1):
            raise ConfigError("qwen3_moe with dense layers (mlp_only_layers/decoder_sparse_step) "
                              "is not supported")
        window = d.get("sliding_window")
        if d.get("use_sliding_window", True) and window and window < d["max_position_embeddings"]:
            raise ConfigError(f"{source or 'config'}: sliding-window attention (sliding_window={window}) "
                              "is not supported")
        eos = d.get("eos_token_id")
        return ModelConfig(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=hidden,
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            max_position_embeddings=d["max_position_embeddings"],
            norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=d.get("rope_theta", 10000.0),
            rope_scaling=d.get("rope_scaling"),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", mt == "qwen2"),
            qk_norm=mt == "qwen3_moe", hidden_act=d.get("hidden_act", "silu"),
            num_experts=(d.get("num_local_experts") or d.get("num_experts") or 0) if moe else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=(d.get("moe_intermediate_size") or d["intermediate_size"]) if moe else 0,
            norm_topk_prob=d.get("norm_topk_prob", mt == "mixtral"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            name=name, source=source, raw=d)
    except KeyError as e:
        raise ConfigError(f"{source or 'config'}: missing field {e.args[0]!r} for model_type {mt!r}") from None


def resolve_model(model: str) -> tuple[ModelConfig, Path | None]:
    """`model` -> (config, model_dir or None). A preset name, a config.json path, or an HF dir."""
    p = Path(model).expanduser()
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.exists():
            raise ConfigError(f"model directory {p} has no config.json")
        return load_config_file(cfg_path, name=p.name), p
    if p.suffix == ".json" and p.exists():
        return load_config_file(p, name=p.stem.removesuffix(".config")), None
    preset = PRESETS_DIR / f"{model}.json"
    if preset.exists():
        return load_config_file(preset, name=model), None
    if p.suffix == ".json" or "/" in model:
        raise ConfigError(f"model {model!r}: no such file or directory")
    raise ConfigError(f"unknown model {model!r}: not a directory, a config.json, or a preset "
                      f"(presets: {', '.join(preset_names())})")


def load_config_file(path: Path, name: str = "") -> ModelConfig:
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: a model config is a JSON object, this holds a {type(d).__name__}")
    return from_hf_dict(d, name=name or Path(path).stem, source=str(path))


def shrink(cfg: ModelConfig, hidden: int = 128, layers: int = 4, vocab: int = 4096,
           max_pos: int = 4096) -> ModelConfig:
    """A CPU-sized copy of `cfg` that keeps the architecture's features.

    Keeps: the GQA ratio (num_heads / num_kv_heads, with 2 kv groups where the original
    has GQA and that stays at 16 heads or fewer), MoE top-k (experts reduced to max(2*top_k, 4) but at most the
    original count), biases, norms, qk-norm, tying, RoPE scaling type, activation.
    head_dim is at least 32.
    """
    ratio = cfg.num_heads // cfg.num_kv_heads
    if ratio == 1:  # multi-head attention
        kv = heads = 4
    elif cfg.num_kv_heads == 1:  # multi-query
        kv, heads = 1, min(cfg.num_heads, 8)
    else:  # grouped-query: two kv groups at the same ratio where that stays small
        kv, heads = (2, 2 * ratio) if 2 * ratio <= 16 else (1, min(ratio, 16))
    head_dim = max(32, hidden // heads)
    experts = min(cfg.num_experts, max(2 * cfg.num_experts_per_tok, 4)) if cfg.is_moe else 0
    rope_scaling = None
    if cfg.rope_scaling:
        rope_scaling = dict(cfg.rope_scaling)
        if "original_max_position_embeddings" in rope_scaling:
            rope_scaling["original_max_position_embeddings"] = max(64, max_pos // 4)
    return dataclasses.replace(
        cfg, vocab_size=min(vocab, cfg.vocab_size), hidden_size=hidden,
        intermediate_size=hidden if cfg.model_type == "mixtral" else hidden * (4 if cfg.model_type == "gpt2" else 3),
        num_layers=min(layers, cfg.num_layers), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        max_position_embeddings=min(max_pos, cfg.max_position_embeddings),
        rope_scaling=rope_scaling, num_experts=experts,
        moe_intermediate_size=hidden if cfg.is_moe else 0,
        bos_token_id=None if cfg.bos_token_id is None else min(cfg.bos_token_id, vocab - 1),
        eos_token_id=None if cfg.eos_token_id is None else min(cfg.eos_token_id, vocab - 1),
        name=f"{cfg.name}-shrunk")


def parse_dtype(name: str):
    import torch
    key = DTYPES.get(name)
    if key is None:
        raise ConfigError(f"bad dtype {name!r}; use one of {sorted(DTYPES)}")
    return getattr(torch, key)
