"""Reference forward passes of every family, on every shipped preset shrunk for the CPU.

Prefill vs prefill+decode agreement, determinism, the static-cache rules, MoE routing,
the safetensors round trip (sharded), loader errors, shrink(), and, where `transformers`
is installed, agreement with the HF implementations.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_server.config import ConfigError, ModelConfig, preset_names, resolve_model, shrink
from engine_server.models import family, moe
from engine_server.state import Batch, State, decode_batch, new_cache, prefill_batch
from engine_server.weights import WeightsError, init_weights, load_weights, save_weights

PRESETS = preset_names()
MOE_PRESETS = [n for n in PRESETS if resolve_model(n)[0].is_moe]
MAX_SEQ = 32
SLOTS = 3
PROMPT = 12


def shrunk(name: str) -> ModelConfig:
    return shrink(resolve_model(name)[0])


def make_state(cfg: ModelConfig, weights=None, dtype=torch.float32) -> State:
    weights = init_weights(cfg, seed=0, dtype=dtype) if weights is None else weights
    k, v = new_cache(cfg, SLOTS, MAX_SEQ, dtype, "cpu")
    return State(cfg, weights, k, v, family(cfg).tables(cfg, weights, MAX_SEQ, dtype, "cpu"),
                 tuple(range(cfg.num_layers)))


def prompt(cfg: ModelConfig, n: int = PROMPT, rows: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (rows, n), generator=g)


def run(state: State, batch: Batch) -> torch.Tensor:
    return family(state.config).forward(state, batch)


def prefill(state: State, tokens: torch.Tensor, slot: int) -> torch.Tensor:
    assert tokens.shape[0] == 1  # one row per slot
    return run(state, prefill_batch(tokens, torch.tensor([slot])))


# --- one preset at a time -------------------------------------------------------------------

@pytest.fixture(scope="module", params=PRESETS)
def preset(request):
    cfg = shrunk(request.param)
    return request.param, cfg, init_weights(cfg, seed=0)


def test_expected_weights_match_init(preset):
    _, cfg, w = preset
    expected = family(cfg).expected_weights(cfg)
    assert set(w) == set(expected)
    for name, shape in expected.items():
        assert tuple(w[name].shape) == tuple(shape), name
        assert w[name].dtype == torch.float32


def test_prefill_matches_prefill_then_decode(preset):
    _, cfg, w = preset
    state = make_state(cfg, w)
    tokens = prompt(cfg)
    full = prefill(state, tokens, slot=0)  # 12 tokens at once, slot 0
    assert full.shape == (1, cfg.vocab_size)
    assert torch.isfinite(full).all()
    slot0 = [k[0].clone() for k in state.k_cache] + [v[0].clone() for v in state.v_cache]
    prefill(state, tokens[:, :-1], slot=1)  # 11 tokens, then the 12th as a decode step, slot 1
    step = run(state, decode_batch(tokens[:, -1], torch.tensor([PROMPT - 1]), torch.tensor([1])))
    assert step.shape == (1, cfg.vocab_size)
    assert torch.isfinite(step).all()
    assert (full - step).abs().max().item() <= 1e-4
    # the slot-1 work leaves slot 0 alone; both slots hold (nearly) the same K/V
    after = [k[0] for k in state.k_cache] + [v[0] for v in state.v_cache]
    assert all(torch.equal(a, b) for a, b in zip(slot0, after))
    for cache in state.k_cache + state.v_cache:
        assert (cache[0, :, :PROMPT] - cache[1, :, :PROMPT]).abs().max().item() <= 1e-4


def test_same_inputs_bitwise_same(preset):
    _, cfg, w = preset
    tokens = prompt(cfg, rows=2)
    a = run(make_state(cfg, w), prefill_batch(tokens, torch.tensor([0, 1])))
    b = run(make_state(cfg, w), prefill_batch(tokens, torch.tensor([0, 1])))
    assert torch.equal(a, b)
    # and again on the same state (same cache cells overwritten with the same values)
    state = make_state(cfg, w)
    batch = prefill_batch(tokens, torch.tensor([0, 2]))
    assert torch.equal(run(state, batch), run(state, batch))


def test_cache_writes_and_noise(preset):
    """K/V land only in the batch's cells; noise in the other cells cannot change logits."""
    _, cfg, w = preset
    tokens = prompt(cfg, n=5, rows=2)
    clean = make_state(cfg, w)
    batch = prefill_batch(tokens, torch.tensor([2, 0]))
    ref = run(clean, batch)

    noisy = make_state(cfg, w)
    g = torch.Generator().manual_seed(7)
    for cache in noisy.k_cache + noisy.v_cache:
        cache.copy_(torch.randn(cache.shape, generator=g) * 1e4)
    before = [c.clone() for c in noisy.k_cache + noisy.v_cache]
    out = run(noisy, batch)
    assert torch.equal(out, ref)
    written = torch.zeros(SLOTS, MAX_SEQ, dtype=torch.bool)
    written[2, :5] = written[0, :5] = True
    for old, new in zip(before, noisy.k_cache + noisy.v_cache):
        assert torch.equal(old[:, :, ~written.any(0)], new[:, :, ~written.any(0)])  # positions >= 5
        assert torch.equal(old[1], new[1])  # the slot the batch does not name


def test_rows_independent(preset):
    """A row's logits do not depend on the other rows of its batch (within float tolerance)."""
    _, cfg, w = preset
    tokens = prompt(cfg, rows=2)
    both = run(make_state(cfg, w), prefill_batch(tokens, torch.tensor([0, 1])))
    for r in range(2):
        alone = prefill(make_state(cfg, w), tokens[r:r + 1], slot=r)
        assert (alone[0] - both[r]).abs().max().item() <= 1e-4


def test_layer_subset(preset):
    """The fast tier runs a subset of layers: logits stay finite and the other layers' cache is untouched."""
    _, cfg, w = preset
    state = make_state(cfg, w).view(layers=(0,))
    out = prefill(state, prompt(cfg), slot=0)
    assert out.shape == (1, cfg.vocab_size) and torch.isfinite(out).all()
    for layer in range(1, cfg.num_layers):
        assert not state.k_cache[layer].any()


# --- MoE ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MOE_PRESETS)
def test_expert_log(name):
    cfg = shrunk(name)
    state = make_state(cfg)
    tokens = prompt(cfg, rows=2)
    batch = prefill_batch(tokens, torch.tensor([0, 1]))
    batch.expert_log = []
    logits = run(state, batch)
    assert len(batch.expert_log) == cfg.num_layers
    for ids in batch.expert_log:
        assert ids.shape == (2 * PROMPT, cfg.num_experts_per_tok)
        assert ids.dtype == torch.int64 and ids.device.type == "cpu"
        assert ids.min() >= 0 and ids.max() < cfg.num_experts
        assert all(len(set(row)) == cfg.num_experts_per_tok for row in ids.tolist())
    summary = moe.experts_active(batch.expert_log)
    assert summary["layers"] == cfg.num_layers
    assert summary["per_layer"] == [len(set(ids.flatten().tolist())) for ids in batch.expert_log]
    assert summary["total"] == sum(summary["per_layer"])
    assert cfg.num_experts_per_tok <= summary["mean_per_layer"] <= cfg.num_experts
    # recording changes nothing
    assert torch.equal(logits, run(make_state(cfg), prefill_batch(tokens, torch.tensor([0, 1]))))
    assert moe.experts_active([]) == {"layers": 0, "per_layer": [], "mean_per_layer": 0.0, "total": 0}


def dense_moe(cfg, w, layer, x):
    """Every token through its top-k experts one by one: a slow, independent statement of the MLP."""
    router = moe.router_name(cfg, layer)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = torch.softmax(x[n] @ w[router].T, dim=-1)
        top = torch.topk(probs, cfg.num_experts_per_tok)
        weights = top.values
        if cfg.model_type == "mixtral" or cfg.norm_topk_prob:
            weights = weights / weights.sum()
        for wt, e in zip(weights, top.indices.tolist()):
            gate, up, down = moe.expert_names(cfg, layer, e)
            out[n] += wt * (w[down] @ (F.silu(w[gate] @ x[n]) * (w[up] @ x[n])))
    return out


@pytest.mark.parametrize("name", MOE_PRESETS)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_mlp_matches_per_token_loop(name, norm_topk_prob):
    cfg = dataclasses.replace(shrunk(name), norm_topk_prob=norm_topk_prob)
    state = make_state(cfg)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    batch = prefill_batch(prompt(cfg, n=7, rows=2), torch.tensor([0, 1]))
    got = moe.moe_mlp(state, 1, x, batch)
    want = dense_moe(cfg, state.weights, 1, x.reshape(-1, cfg.hidden_size)).view_as(x)
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got, moe.moe_mlp(state, 1, x, batch))


def test_moe_renormalisation_rule():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    mix = dataclasses.replace(shrunk("mixtral-8x7b-v0.1"), norm_topk_prob=False)  # Mixtral always renormalises
    w, e = moe.route(mix, logits, torch.float32)
    assert e.tolist() == [[0, 1]] and torch.allclose(w.sum(-1), torch.ones(1))
    q = dataclasses.replace(shrunk("qwen3-30b-a3b"), norm_topk_prob=False, num_experts_per_tok=2)
    w, _ = moe.route(q, logits, torch.float32)
    assert torch.allclose(w, torch.softmax(logits, -1)[:, :2])
    w, _ = moe.route(dataclasses.replace(q, norm_topk_prob=True), logits, torch.bfloat16)
    assert w.dtype == torch.bfloat16


# --- safetensors round trip -----------------------------------------------------------------

ROUND_TRIP = ["llama-3.2-1b", "gpt2", "mixtral-8x7b-v0.1", "qwen3-30b-a3b"]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_safetensors_round_trip(name, tmp_path):
    cfg = shrunk(name)
    w = init_weights(cfg, seed=0)
    total = sum(t.numel() * t.element_size() for t in w.values())
    save_weights(w, cfg, tmp_path, max_shard_bytes=total // 4)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(w)

    cfg2, model_dir = resolve_model(str(tmp_path))
    assert model_dir == tmp_path
    assert family(cfg2).expected_weights(cfg2) == family(cfg).expected_weights(cfg)
    w2 = load_weights(model_dir, cfg2)
    assert set(w2) == set(w) and all(torch.equal(w[k], w2[k]) for k in w)
    tokens = prompt(cfg)
    assert torch.equal(prefill(make_state(cfg, w), tokens, 0), prefill(make_state(cfg2, w2), tokens, 0))


def test_gpt2_checkpoint_names_without_prefix(tmp_path):
    """Real GPT-2 checkpoints store `h.0...`/`wte.weight` and the causal-mask buffers."""
    from safetensors.torch import save_file
    cfg = shrunk("gpt2")
    w = init_weights(cfg, seed=0)
    save_weights(w, cfg, tmp_path)  # writes config.json
    bare = {k.removeprefix("transformer."): v.contiguous() for k, v in w.items()}
    bare["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.uint8))
    bare["lm_head.weight"] = w["transformer.wte.weight"].clone()  # tied, stored anyway
    save_file(bare, str(tmp_path / "model.safetensors"))
    cfg2, d = resolve_model(str(tmp_path))
    w2 = load_weights(d, cfg2)
    assert set(w2) == set(w) and all(torch.equal(w[k], w2[k]) for k in w)


# --- errors ---------------------------------------------------------------------------------

def write_checkpoint(tmp_path: Path, name: str, edit) -> tuple[ModelConfig, Path]:
    from safetensors.torch import save_file
    cfg = shrunk(name)
    w = init_weights(cfg, seed=0)
    save_weights(w, cfg, tmp_path)
    edit(w)
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp_path / "model.safetensors"))
    return resolve_model(str(tmp_path))


VICTIM = "model.layers.1.self_attn.k_proj.weight"


def test_missing_tensor(tmp_path):
    cfg, d = write_checkpoint(tmp_path, "llama-3.2-1b", lambda w: w.pop(VICTIM))
    with pytest.raises(WeightsError, match=VICTIM.replace(".", r"\.")):
        load_weights(d, cfg)


def test_missing_expert_tensor(tmp_path):
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    cfg, d = write_checkpoint(tmp_path, "mixtral-8x7b-v0.1", lambda w: w.pop(name))
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        load_weights(d, cfg)


def test_misshapen_tensor(tmp_path):
    def edit(w):
        w[VICTIM] = w[VICTIM][:, :-1]
    cfg, d = write_checkpoint(tmp_path, "llama-3.2-1b", edit)
    with pytest.raises(WeightsError, match=VICTIM.replace(".", r"\.") + ".*shape"):
        load_weights(d, cfg)


def test_int_tensor(tmp_path):
    name = "transformer.h.0.mlp.c_fc.weight"
    def edit(w):
        w[name] = torch.zeros(w[name].shape, dtype=torch.int32)
    cfg, d = write_checkpoint(tmp_path, "gpt2", edit)
    with pytest.raises(WeightsError, match=name.replace(".", r"\.") + ".*dtype"):
        load_weights(d, cfg)


def test_unexpected_tensor(tmp_path):
    def edit(w):
        w["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
    cfg, d = write_checkpoint(tmp_path, "qwen3-30b-a3b", edit)  # MoE: no dense MLP
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_weights(d, cfg)


def test_missing_shard(tmp_path):
    cfg = shrunk("gpt2")
    w = init_weights(cfg, seed=0)
    total = sum(t.numel() * t.element_size() for t in w.values())
    save_weights(w, cfg, tmp_path, max_shard_bytes=total // 4)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    cfg2, d = resolve_model(str(tmp_path))
    with pytest.raises(WeightsError, match=victim.name):
        load_weights(d, cfg2)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="bert"):
        resolve_model(str(tmp_path))


def test_missing_config_field(tmp_path):
    d = json.loads((Path(__file__).parents[1] / "engine_server/presets/llama-3.2-1b.json").read_text())
    del d["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        resolve_model(str(tmp_path))


def test_gpt2_bad_geometry_and_activation():
    cfg = shrunk("gpt2")
    with pytest.raises(ConfigError, match="head_dim"):
        family(cfg).expected_weights(dataclasses.replace(cfg, head_dim=cfg.head_dim * 2))
    with pytest.raises(ConfigError, match="swiglu"):
        family(cfg).expected_weights(dataclasses.replace(cfg, hidden_act="swiglu"))


# --- shrink ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_shrink_keeps_architecture(name):
    big = resolve_model(name)[0]
    small = shrink(big)
    assert small.model_type == big.model_type
    assert small.num_heads % small.num_kv_heads == 0
    assert small.num_heads // small.num_kv_heads == big.num_heads // big.num_kv_heads  # GQA ratio
    assert (small.num_kv_heads == small.num_heads) == (big.num_kv_heads == big.num_heads)  # MHA stays MHA
    assert small.num_experts_per_tok == big.num_experts_per_tok  # top-k
    assert small.is_moe == big.is_moe
    if big.is_moe:
        assert small.num_experts_per_tok < small.num_experts <= big.num_experts
        assert small.moe_intermediate_size > 0
    assert small.attention_bias == big.attention_bias
    assert small.qk_norm == big.qk_norm
    assert small.tie_word_embeddings == big.tie_word_embeddings
    assert small.norm_eps == big.norm_eps and small.hidden_act == big.hidden_act
    assert small.norm_topk_prob == big.norm_topk_prob
    kind = lambda rs: None if not rs else rs.get("rope_type", rs.get("type"))  # noqa: E731
    assert kind(small.rope_scaling) == kind(big.rope_scaling)
    assert small.head_dim >= 32
    assert small.max_position_embeddings >= MAX_SEQ
    assert small.hidden_size <= 256 and small.num_layers <= 4 and small.vocab_size <= 4096
    if big.model_type == "gpt2":
        assert small.hidden_size == small.num_heads * small.head_dim


# --- against transformers (only where it is installed) --------------------------------------

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.mark.parametrize("name", PRESETS)
def test_matches_transformers(name, tmp_path):
    """Our reference vs transformers' own model, loaded from the directory we saved."""
    transformers = pytest.importorskip("transformers")
    cfg = shrunk(name)
    cls = getattr(transformers, HF_CLASSES[cfg.model_type], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {HF_CLASSES[cfg.model_type]}")
    w = init_weights(cfg, seed=0)
    save_weights(w, cfg, tmp_path)
    hf = cls.from_pretrained(str(tmp_path)).float().eval()
    tokens = prompt(cfg)
    with torch.no_grad():
        want = hf(input_ids=tokens).logits[:, -1]
    got = prefill(make_state(cfg, w), tokens, slot=0)
    assert (got - want).abs().max().item() <= 1e-4
