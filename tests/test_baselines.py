"""The baselines compute what the engine's reference computes (same weights, same prompt), and
forward_bench.py runs end to end on the CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import baselines, forward_bench, pick_variant
from engine_server.config import resolve_model, shrink
from engine_server.models import family
from engine_server.state import State, decode_batch, new_cache, prefill_batch
from engine_server.weights import init_weights

ROOT = Path(__file__).resolve().parent.parent


def _setup(model: str):
    cfg = shrink(resolve_model(model)[0])
    w = init_weights(cfg, seed=1)
    fam = family(cfg)
    k, v = new_cache(cfg, 1, 64, torch.float32, "cpu")
    state = State(cfg, w, k, v, fam.tables(cfg, w, 64, torch.float32, "cpu"), tuple(range(cfg.num_layers)))
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    return cfg, w, fam, state, prompt


def _reference_greedy(fam, state, prompt, steps):
    slot = torch.tensor([0])
    logits = [fam.forward(state, prefill_batch(torch.tensor([prompt]), slot))]
    for i in range(steps):
        tok = logits[-1].argmax(-1)
        logits.append(fam.forward(state, decode_batch(tok, torch.tensor([len(prompt) + i]), slot)))
    return logits, [int(x.argmax(-1)) for x in logits]


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen2.5-0.5b"])
def test_decoder_matches_the_engine_reference(model):
    cfg, w, fam, state, prompt = _setup(model)
    ref_logits, ref_tokens = _reference_greedy(fam, state, prompt, 8)
    dec = baselines.Decoder(cfg, 64).setup(torch.float32, "cpu").load_hf(w).eval()
    with torch.no_grad():
        out = [dec(torch.tensor([prompt]), torch.arange(len(prompt)))]
        for i, tok in enumerate(ref_tokens[:-1]):
            out.append(dec(torch.tensor([[tok]]), torch.tensor([len(prompt) + i])))
    for r, o in zip(ref_logits, out):
        torch.testing.assert_close(o, r, atol=2e-4, rtol=1e-4)
    # the timed path (eager here) gives the same greedy tokens
    res = baselines.compiled_decode_rate(cfg, "cpu", torch.float32, context=len(prompt), steps=8, warmup=2,
                                         repeats=1, weights=w, prompt=prompt, mode=None)
    assert res.ok, res.error
    assert res.tokens == ref_tokens and res.tok_s > 0


def test_decoder_without_weights_and_bad_family():
    cfg = shrink(resolve_model("llama-3.2-1b")[0])
    res = baselines.compiled_decode_rate(cfg, "cpu", torch.float32, context=8, steps=4, warmup=1, repeats=1,
                                         mode=None)
    assert res.ok and len(res.tokens) == 5
    bad = baselines.compiled_decode_rate(shrink(resolve_model("gpt2")[0]), "cpu", torch.float32, context=8,
                                         steps=4, mode=None)
    assert not bad.ok and "dense Llama-family" in bad.error


def test_hf_baseline_matches_the_engine_reference():
    pytest.importorskip("transformers")
    cfg, w, fam, state, prompt = _setup("llama-3.2-1b")
    _, ref_tokens = _reference_greedy(fam, state, prompt, 6)
    res = baselines.hf_decode_rate(cfg, "cpu", torch.float32, context=len(prompt), steps=6, repeats=1,
                                   weights=w, prompt=prompt)
    assert res.ok, res.error
    assert res.tokens == ref_tokens and res.tok_s > 0
    assert any("default cache" in n for n in res.notes)


def test_knobs_rewrite_and_neighbours():
    src = ("import x\n# é\nKNOBS = {\n    'BLOCK': 64,  # c\n    'mlp': {'num_warps': 4, 'stages': 3},\n"
           "    's': 'a',\n}\nY = 1\n")
    knobs, span = forward_bench.find_knobs(src)
    assert knobs == {"BLOCK": 64, "mlp": {"num_warps": 4, "stages": 3}, "s": "a"}
    assert [p for p, _ in forward_bench.leaves(knobs)] == [("BLOCK",), ("mlp", "num_warps"), ("mlp", "stages")]
    new = forward_bench.with_value(knobs, ("mlp", "stages"), 4)
    out = forward_bench.rewrite_knobs(src, span, new)
    assert forward_bench.find_knobs(out)[0] == new and out.startswith("import x\n# é\n") and out.endswith("Y = 1\n")
    assert forward_bench.neighbours(64) == [128, 32] and forward_bench.neighbours(3) == [4, 2]
    assert forward_bench.neighbours(True) == [False] and forward_bench.neighbours("a") == []
    assert forward_bench.find_knobs("def forward(state, batch):\n    pass\n") is None
    assert forward_bench.merged({"a": {"x": 1, "y": 2}, "b": 3}, {"a": {"y": 5}, "c": True}) == \
        {"a": {"x": 1, "y": 5}, "b": 3, "c": True}
    assert forward_bench.is_candidate("def forward(state, batch):\n    pass\n")
    assert forward_bench.is_candidate("from engine_server.models.llama import forward\n")
    assert not forward_bench.is_candidate("def main():\n    pass\n")


def test_forward_bench_variants_write_merged_copies(tmp_path):
    src = "KNOBS = {\n    'a': {'x': 1, 'y': 2},\n    'b': False,\n}\n\ndef forward(state, batch):\n    pass\n"
    (tmp_path / "cand.py").write_text(src)
    files = forward_bench.write_variants(tmp_path / "cand.py", {"y5": {"a": {"y": 5}}, "b": {"b": True}},
                                         tmp_path / "v")
    assert [f.name for f in files] == ["cand-y5.py", "cand-b.py"]
    assert forward_bench.find_knobs(files[0].read_text())[0] == {"a": {"x": 1, "y": 5}, "b": False}
    assert forward_bench.find_knobs(files[1].read_text())[0] == {"a": {"x": 1, "y": 2}, "b": True}
    assert files[1].read_text().endswith("def forward(state, batch):\n    pass\n")
    (tmp_path / "plain.py").write_text("def forward(state, batch):\n    pass\n")
    with pytest.raises(ValueError, match="no KNOBS"):
        forward_bench.write_variants(tmp_path / "plain.py", {"x": {}}, tmp_path / "v")


def test_pick_variant_takes_the_fastest_gated_copy_past_every_base_run(tmp_path):
    def row(name, tok_s, gate="tolerance"):
        return {"name": name, "file": f"/v/{name}.py", "tok_s": tok_s, "gate": gate}
    res = {"files": ["examples/c.py"], "variants": {"base": {}, "fast": {"a": 1}, "faster": {"a": 2}, "slow": {},
                                                     "baseline_knob": {"b": 1}, "base2": {}},
           "winners": [row("c", 1000.0), row("c-base", 1005.0), row("c-fast", 1010.0), row("c-faster", 1030.0, "fail"),
                       row("c-slow", 990.0), row("c-baseline_knob", 1008.0), row("c-base2", 1001.0),
                       {"name": "c-broken", "file": "/v/c-broken.py", "tok_s": None, "error": "boom"}]}
    best, why = pick_variant.pick(res, 0.003)
    assert best["name"] == "c-fast" and "1005.0" in why  # the failed gate is out; the base's best is the bar
    assert pick_variant.pick(res, 0.01)[0] is None  # +0.5% is inside a 1% margin
    res["winners"][1]["tok_s"] = 1009.0  # a base run as fast: "baseline_knob" has overrides, so it is a variant
    assert pick_variant.pick(res, 0.0)[0]["name"] == "c-fast"
    res["winners"][1]["tok_s"] = 1012.0
    assert pick_variant.pick(res, 0.0)[0] is None
    assert pick_variant.pick({"files": ["c.py"], "variants": {}, "winners": []}, 0.0) == (None, "no variants measured")
    (tmp_path / "v.json").write_text(json.dumps(res | {"winners": [row("c", 1000.0), row("c-fast", 1010.0)]}))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pick_variant.py"), str(tmp_path / "v.json"),
                        "--margin", "0.001"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "/v/c-fast.py\n" and "take c-fast" in p.stderr


# a stream_bench.py JSON: two checked tilings of down and the file's own, one that failed, one of qkv
STREAM = {"results": [
    {"shape": "down", "rows": [{"knobs": {}, "own": True, "ok": True, "us": 0.5},
                               {"knobs": {"num_warps": 2}, "ok": False, "failure": "OutOfResources"},
                               {"knobs": {"BLOCK_N": 32}, "ok": True, "us": 2.0},
                               {"knobs": {"BLOCK_N": 8, "num_warps": 4}, "ok": True, "us": 1.0}]},
    {"shape": "qkv", "rows": [{"knobs": {"BLOCK_N": 4}, "ok": True, "us": 1.0}]}]}


def test_tiling_seeds_take_each_projections_fastest_checked_tilings(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(STREAM))
    assert forward_bench.tiling_seeds(str(tmp_path / "s.json"), 2) == [
        ("down", {"BLOCK_N": 8, "num_warps": 4}), ("down", {"BLOCK_N": 32}), ("qkv", {"BLOCK_N": 4})]
    assert forward_bench.tiling_seeds(str(tmp_path / "s.json"), 1)[0] == ("down", {"BLOCK_N": 8, "num_warps": 4})


def test_climb_time_shares_the_budget_and_says_when_the_total_leaves_none():
    assert forward_bench.climb_time(60.0, 200.0, 2) == (30.0, None)  # the budget bounds it, shared
    assert forward_bench.climb_time(60.0, 20.0, 1) == (20.0, None)  # the total bounds it
    assert forward_bench.climb_time(0.0, -50.0, 1) == (0.0, None)  # no budget asked: nothing to say
    share, why = forward_bench.climb_time(60.0, -65.0, 1)  # the H100 run of TOTAL_S=180 with 4 files
    assert share == 0.0 and "--total-s" in why and "125 s more" in why


def test_overrides_name_only_knobs_the_file_reads(tmp_path):
    src = ("KNOBS = {'qkv': {'BLOCK_N': 16}, 'l2': {'AT': 'wait'}}  # 'nope' here is in no code\n\n\n"
           "def forward(state, batch):\n    return KNOBS['qkv'].get(\"maxnreg\")\n")
    assert forward_bench.unknown_knobs(src, {"qkv": {"BLOCK_N": 8, "maxnreg": 64}, "l2": {"AT": "entry"}}) == []
    assert forward_bench.unknown_knobs(src, {"qkv": {"BLOCK_NN": 8}, "nope": 1, "l2": {"AT": "x"}}) == [
        "KNOBS['qkv']['BLOCK_NN']", "KNOBS['nope']"]
    with pytest.raises(ValueError, match=r"BLOCK_NN.*misspelt"):
        forward_bench.override_knobs(src, {"qkv": {"BLOCK_NN": 8}}, "f.py")
    assert "'maxnreg': 64" in forward_bench.override_knobs(src, {"qkv": {"maxnreg": 64}})
    # the bench refuses such overrides before it builds an engine: exit 2 and why, in seconds
    (tmp_path / "k.py").write_text(src)
    (tmp_path / "plain.py").write_text("def forward(state, batch):\n    return None\n")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "forward_bench.py"), "--shrink", "--device", "cpu"]
    for extra, why in ((["--variants", '{"a": {"qkv": {"BLOCK_NN": 8}}}', "k.py"], "--variants: k.py has no KNOBS['qkv']['BLOCK_NN']"),
                       (["--variants", '{"a": 1}', "k.py"], "--variants must be a JSON object of name -> KNOBS"),
                       (["--variants", '{"a": {}}', "plain.py"], "plain.py has no KNOBS literal"),
                       (["--start-knobs", "{x", "k.py"], "--start-knobs is not JSON"),
                       (["--start-knobs", '{"nope": 1}', "plain.py", "k.py"], "--start-knobs: k.py has no KNOBS['nope']")):
        p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert p.returncode == 2 and why in p.stderr and "engine ready" not in p.stdout + p.stderr, p.stderr[-2000:]
    assert forward_bench.check_overrides(forward_bench.parser().parse_args(
        ["--start-knobs", '{"nope": 1}', "--climb", "plain", str(tmp_path / "plain.py"), str(tmp_path / "k.py")])) is None


def test_forward_bench_runs_on_cpu(tmp_path):
    ref = (ROOT / "engine_server" / "models" / "llama.py").read_text()
    (tmp_path / "knobbed.py").write_text("from engine_server.models import llama as ref\n\n"
                                         "KNOBS = {'BLOCK_N': 64, 'down': {'BLOCK_N': 16, 'num_warps': 8}}\n\n\n"
                                         "def forward(state, batch):\n    return ref.forward(state, batch)\n")
    (tmp_path / "stream.json").write_text(json.dumps(STREAM))
    (tmp_path / "copy.py").write_text(ref)
    (tmp_path / "broken.py").write_text("def forward(state, batch):\n    raise RuntimeError('nope')\n")
    (tmp_path / "helper.py").write_text("def main():\n    pass\n")
    env = dict(os.environ, TKCC_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "forward_bench.py"), "--shrink", "--device", "cpu",
           "--skip-hf", "--compile-mode", "none", "--context", "16", "--steps", "6", "--repeats", "1",
           "--budget-s", "6", "--no-full", "--fast-rounds", "5", "--winners-dir", str(tmp_path / "win"),
           "--start-knobs", '{"BLOCK_N": 32}', "--tilings", str(tmp_path / "stream.json"), "--tiling-seeds", "1",
           str(tmp_path / "knobbed.py"), str(tmp_path / "copy.py"), str(tmp_path / "broken.py"),
           str(tmp_path / "helper.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    rows = {w["name"]: w for w in res["winners"]}
    assert rows["copy"]["gate"] == "bitwise" and rows["copy"]["bitwise"]["exact"]
    assert rows["copy"]["tolerance"]["close"] and rows["copy"]["fast"]["ok"]
    assert rows["copy"]["tokens_match_reference"] == 7
    assert rows["knobbed"]["gate"] == "bitwise" and res["climb"]["trials"][0]["role"] == "start"
    assert rows["knobbed"]["knobs_start"] == {"BLOCK_N": 32, "down": {"BLOCK_N": 16, "num_warps": 8}}  # --start-knobs
    # --tilings: the climb's first move is down's fastest tiling alone; qkv's, a group the file has not, is left out
    seeds = [t for t in res["climb"]["trials"] if t.get("role") == "seed"]
    assert [t["knobs"]["down"] for t in seeds] == [{"BLOCK_N": 8, "num_warps": 4}], seeds
    assert res["climb"]["trials"][1]["role"] == "seed"  # before any single-knob move
    assert "nope" in rows["broken"]["error"] and "helper" not in rows
    assert res["not_candidates"] == [str(tmp_path / "helper.py")]
    assert res["reference"]["tok_s"] > 0 and res["baselines"]["compile"]["ok"]
    assert res["baselines_left_changed"] == []  # nothing of the engine's watched process to put back
    assert {r["name"] for r in res["table"]} >= {"engine reference", "copy", "knobbed", "broken"}
    assert (tmp_path / "win" / "copy.py").read_text() == ref and (tmp_path / "win" / "results.json").exists()
    assert not (tmp_path / "win" / "broken.py").exists()
    assert "x ref" in p.stdout


def test_forward_bench_sizes_the_cache_for_its_run():
    """The default run (context 512, 256 steps) fits the engine's KV cache on the CPU, whose
    default is 512 positions; a device default already long enough is kept."""
    a = forward_bench.parser().parse_args(["--device", "cpu", "--shrink"])
    assert (a.context, a.steps) == (512, 256)
    assert forward_bench.engine_config(a).max_seq == 769
    a.context, a.steps = 16, 6
    assert forward_bench.engine_config(a).max_seq == 512
    a.device = "cuda"
    assert forward_bench.engine_config(a).max_seq == 4096


def test_climb_looks_past_a_plateau():
    """A knob whose first doubling gains less than --min-gain but whose second gains more:
    the climb takes one more step past the plateau and keeps it; a loss stops it."""
    from types import SimpleNamespace as NS
    score = {4: 1.0, 8: 1.004, 16: 1.05, 32: 0.9, 2: 0.99, 1: 0.98}  # objective by num_warps

    class Eng:
        cuda = False
        objs: dict = {}

        def measure_fast(self, cid):
            o = self.objs[cid]
            return NS(ok=True, valid=True, speedup=o, shapes=[NS(batch=1, shape="decode B=1", speedup=o)])

        def check_bit_exact(self, cid, mode="bitwise"):
            return NS(ok=True, exact=True, close=True, tokens_equal=True, kv_equal=True, max_abs_diff=0.0,
                      candidate_error=None, reference_error=None, tolerance_used=None, first_mismatch=None,
                      token_divergence=None, violations=[], error=None, seconds=0.0)

        def remove(self, cid):
            pass

    class Stub(forward_bench.Run):
        def try_candidate(self, name, source, parent):
            o = score[forward_bench.find_knobs(source)[0]["w"]]
            cid = f"c{len(self.trials)}"
            self.eng.objs[cid] = o
            return {"name": name, "ok": True, "candidate_id": cid, "objective": o, "samples": [o]}

    src = "KNOBS = {'w': 4}\n\ndef forward(state, batch):\n    pass\n"
    run = Stub(Eng(), NS(min_gain=0.01), 0.0)
    out = run.climb(Path("k.py"), src, budget_s=60)
    assert out["knobs"] == {"w": 16} and out["moves"] == 1, out
    tried = [t["name"] for t in run.trials]
    assert "k[w=8]" in tried and "k[w=16]" in tried and "k[w=32]" in tried and "k[w=64]" not in tried
    assert forward_bench.beyond(4, 8) == 16 and forward_bench.beyond(4, 2) == 1 and forward_bench.beyond(1, 2) == 4
    assert forward_bench.beyond(3, 4) == 5 and forward_bench.beyond(2, 1) is None and forward_bench.beyond(True, False) is None
