"""GPU tests: run on the H200 with `python -m pytest -m gpu tests/test_gpu.py`."""
import pytest
import torch

from conftest import CHEATERS, example_source

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_engine():
    from engine_server.engine import Engine, EngineConfig
    return Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cuda", call_timeout_s=60))


def _no_gain(fm) -> bool:
    """No fast-tier gain that noise does not explain: the interval's low end is at most 1 (a
    measured loss is no gain), or the speedup is within 5% of 1 (a reference copy's noise)."""
    return fm.speedup_ci95[0] <= 1.0 or abs(fm.speedup - 1) < 0.05


def test_reference_copy_is_exact_under_graphs(cuda_engine):
    from engine_server.selfcheck import perturbed_source, reference_source
    r = cuda_engine.submit_forward_pass(reference_source(cuda_engine))
    assert r.ok and r.graphs, (r.error, r.notes)
    ex = cuda_engine.check_bit_exact(r.candidate_id)
    assert ex.exact, ex
    fm = cuda_engine.measure_fast(r.candidate_id)
    assert fm.valid and fm.speedup_ci95[0] <= 1.0 <= fm.speedup_ci95[1] or abs(fm.speedup - 1) < 0.05, fm
    full = cuda_engine.measure_full(r.candidate_id)
    assert full.valid and full.tokens_match == 1.0
    p = cuda_engine.submit_forward_pass(perturbed_source(cuda_engine))
    assert not cuda_engine.check_bit_exact(p.candidate_id).exact


@pytest.mark.parametrize("name", sorted(p.stem for p in CHEATERS.glob("*.py")))
def test_cheaters_caught_on_cuda(cuda_engine, name):
    r = cuda_engine.submit_forward_pass((CHEATERS / f"{name}.py").read_text())
    if not r.ok:
        return
    ex = cuda_engine.check_bit_exact(r.candidate_id)
    fm = cuda_engine.measure_fast(r.candidate_id)
    # caught, or (side streams inside a captured graph are joined by the capture; a pass that
    # adapts to what it sees runs eagerly only in the prefill) no gain it can tell from noise
    assert not (ex.exact and fm.valid) or (r.graphs and _no_gain(fm)), (name, ex, fm)


def test_side_stream_caught_when_run_eagerly():
    from engine_server.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cuda", capture_graphs=False))
    r = eng.submit_forward_pass((CHEATERS / "side_stream.py").read_text())
    ex = eng.check_bit_exact(r.candidate_id)
    assert not ex.exact, ex


def test_moe_reference_runs_eagerly_and_is_exact():
    from engine_server.engine import Engine, EngineConfig
    from engine_server.selfcheck import reference_source
    eng = Engine(EngineConfig(model="qwen3-30b-a3b", shrink=True, device="cuda"))
    r = eng.submit_forward_pass(reference_source(eng))
    assert r.ok
    assert eng.check_bit_exact(r.candidate_id).exact
    assert eng.measure_fast(r.candidate_id).experts_active > 0


def test_serving_batches_through_graphs_and_promotes_without_failures(tmp_path):
    """The serving scheduler on CUDA (no HTTP: the GPU image has no web stack): concurrent
    requests share decode steps through padded graph batches; a promotion mid-run fails none,
    and greedy outputs equal those of a run with no promotion (the pass is exact)."""
    import time

    from engine_server.config import EngineConfig
    from engine_server.selfcheck import reference_source
    from engine_server.serving import GenRequest, ServeConfig, Service

    svc = Service(EngineConfig(model="llama-3.2-1b", shrink=True, device="cuda"), ServeConfig(home=str(tmp_path)))
    svc.start()
    try:
        def batch(promote_after: float | None):
            reqs = [GenRequest(prompt=svc.encode(f"request {i}: " + "tokens " * (3 * i + 1)), max_tokens=24,
                               ignore_eos=True) for i in range(6)]
            for r in reqs:
                svc.scheduler.submit(r)
            if promote_after is not None:
                time.sleep(promote_after)
                assert svc.promote(reference_source(svc.engine), name="copy")["ok"]
            deadline = time.time() + 120
            while any(r.finish_reason is None for r in reqs):
                assert time.time() < deadline
                time.sleep(0.01)
            return reqs

        first = batch(promote_after=0.05)
        assert all(r.finish_reason == "length" and len(r.out) == 24 for r in first)
        assert svc.metrics.failures == 0
        second = batch(promote_after=None)
        assert [r.out for r in first] == [r.out for r in second]
        assert max(s.rows for s in svc.scheduler.steps) > 1  # rows shared a decode step
    finally:
        svc.close()


def test_triton_decode_example_passes_the_tolerance_gate(cuda_engine):
    """Not bitwise (another summation order), but no further from the float32 reference than
    twice the bf16 reference, identical tokens, and valid on both tiers (near ties allowed)."""
    src = example_source("llama_triton_decode")
    r = cuda_engine.submit_forward_pass(src, name="triton-decode")
    assert r.ok and r.graphs, (r.error, r.notes)
    assert not cuda_engine.check_bit_exact(r.candidate_id).exact
    tol = cuda_engine.check_bit_exact(r.candidate_id, mode="tolerance")
    assert tol.close and tol.tokens_equal and 0 < tol.tolerance_used <= 1.0, tol
    assert tol.tolerance["wide_dtype"] == "torch.float32"
    fm = cuda_engine.measure_fast(r.candidate_id)
    assert fm.valid and fm.outputs_match == "close", (fm.violations, fm.config.get("depth_check"), fm.config.get("stopped"))
    full = cuda_engine.measure_full(r.candidate_id)
    assert full.valid and full.outputs_match in ("tokens", "tokens-near-ties"), full


def test_triton_decode_with_folded_norms_passes_the_tolerance_gate(cuda_engine):
    """KNOBS["norm"]["FOLD"] (no norm kernels, a float32 residual that o and down add into
    atomically): the graph replays what the eager step computes to within a last-bit flip of
    the atomics' order, and the pass stays within the tolerance gate with identical tokens."""
    from engine_server.state import decode_batch
    fold = example_source("llama_triton_decode", {"norm": {"FOLD": True}})
    r = cuda_engine.submit_forward_pass(fold, name="triton-fold")
    assert r.ok and r.graphs, (r.error, r.notes)
    c = cuda_engine.candidates[r.candidate_id]
    st = cuda_engine.candidate_state(c)
    b = decode_batch(torch.tensor([5], device="cuda"), torch.tensor([300], device="cuda"),
                     torch.tensor([0], device="cuda"))
    eager, replay = c.forward(st, b).float(), c.graphs.run(st, b).float()
    assert torch.allclose(eager, replay, rtol=2e-2, atol=2e-2 * eager.abs().max().item())
    tol = cuda_engine.check_bit_exact(r.candidate_id, mode="tolerance")
    assert tol.close and tol.tokens_equal and 0 < tol.tolerance_used <= 1.0, tol
    fm = cuda_engine.measure_fast(r.candidate_id)
    assert fm.valid and fm.outputs_match == "close", (fm.violations, fm.config.get("depth_check"), fm.config.get("stopped"))


def _same_logits(engine, sources: dict[str, str], rel: float = 0.0) -> list[str]:
    """Submit each named source (each must capture graphs), run one batch-1 decode step of each
    eagerly and from its graph, assert all the logits are bitwise equal (rel > 0: within rel of
    the largest, for passes whose atomics land in any order); the candidates' ids."""
    from engine_server.state import decode_batch
    ids = []
    for name, src in sources.items():
        r = engine.submit_forward_pass(src, name=name)
        assert r.ok and r.graphs, (r.error, r.notes)
        ids.append(r.candidate_id)
    b = decode_batch(torch.tensor([5], device="cuda"), torch.tensor([300], device="cuda"),
                     torch.tensor([0], device="cuda"))
    outs = []
    for cid in ids:
        c = engine.candidates[cid]
        st = engine.candidate_state(c)
        outs.append((c.forward(st, b).clone(), c.graphs.run(st, b).clone()))
    def same(a, b):
        if rel == 0:
            return torch.equal(a, b)
        return torch.allclose(a.float(), b.float(), rtol=rel, atol=rel * a.float().abs().max().item())
    assert all(same(outs[0][0], o[0]) and same(outs[0][1], o[1]) for o in outs[1:])
    return ids


@pytest.mark.gpu
def test_triton_decode_pdl_changes_timing_not_results(cuda_engine):
    """KNOBS["pdl"] on launches the same kernels with programmatic dependent launch and L2
    prefetches: the logits are bitwise those of plain launches, eager and from the captured
    graph, and the tolerance gate measures the same error for both."""
    on = example_source("llama_triton_decode", {"pdl": {"enabled": True}})
    off = example_source("llama_triton_decode", {"pdl": {"enabled": False}})
    ids = _same_logits(cuda_engine, {"pdl-off": off, "pdl-on": on})
    tol = [cuda_engine.check_bit_exact(cid, mode="tolerance") for cid in ids]
    assert tol[1].close and tol[1].tokens_equal, tol[1]
    assert tol[1].candidate_error == tol[0].candidate_error


@pytest.mark.gpu
def test_l2_prefetches_and_register_cap_change_timing_not_results(cuda_engine):
    """The H200 winner with KNOBS["l2"]["GATE_UP_STEPS"] (bulk L2 prefetches from o_proj),
    END_DOWN and END_QKV (from gate_up's and down's programs as they finish) and gate_up's
    maxnreg: the same logits as without them, eager and from the graph: bitwise with the norms
    unfolded, and folded (o and down add into the residual atomically, in any order) within the
    last-bit flips the folded pass's own test allows."""
    h200 = "llama_triton_decode_h200"
    # the shrunk preset's rows are 128 wide: gate_up on 32-column K steps, so that some follow PRE
    off = {"gate_up": {"BLOCK_K": 32}, "l2": {"GATE_UP_STEPS": 0, "END_DOWN": False, "END_QKV": False}}
    on = {"gate_up": {"BLOCK_K": 32, "maxnreg": 128},
          "l2": {"GATE_UP_STEPS": 2, "BY": "o", "AT": "entry", "END_DOWN": True, "END_QKV": True}}
    for fold in (False, True):
        _same_logits(cuda_engine, {f"l2-off-fold-{fold}": example_source(h200, {**off, "norm": {"FOLD": fold}}),
                                   f"l2-on-fold-{fold}": example_source(h200, {**on, "norm": {"FOLD": fold}})},
                     rel=2e-2 if fold else 0.0)


@pytest.mark.gpu
def test_qkv_rope_and_smem_keep_the_step(cuda_engine):
    """The decode example (exact softmax: no near tie on the shrunk preset) with qkv unsplit,
    then qkv's ROPE (RoPE and this step's K/V write in qkv's kernel): the same logits as without
    it, eager and from the graph (bitwise with the norms unfolded, folded within the atomics'
    last-bit flips). With the norms folded and qkv's SMEM (a Gluon kernel holding its rows in
    shared memory, "async" and "tma"; another summation order): the tolerance gate with
    identical tokens, and that kernel is the one that ran."""
    qkv = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "PIPE": False, "ROPE": False, "SMEM": False}

    def src(fold: bool, **over) -> str:
        return example_source("llama_triton_decode", {"qkv": {**qkv, **over}, "norm": {"FOLD": fold}})
    _same_logits(cuda_engine, {"rope-off": src(False), "rope-on": src(False, ROPE=True)})
    _same_logits(cuda_engine, {"rope-off-folded": src(True), "rope-on-folded": src(True, ROPE=True)}, rel=2e-2)
    for mode, bk in (("async", 128), ("tma", 64)):  # the shrunk preset's rows: 128 columns
        smem = src(True, BLOCK_N=32, BLOCK_K=bk, SMEM=mode)
        r = cuda_engine.submit_forward_pass(smem, name=f"qkv-smem-{mode}")
        assert r.ok and r.graphs, (r.error, r.notes)
        assert cuda_engine.candidates[r.candidate_id].module._smem_capable(torch.device("cuda")) > 0
        tol = cuda_engine.check_bit_exact(r.candidate_id, mode="tolerance")
        assert tol.close and tol.tokens_equal, (mode, tol)


def test_persistent_example_is_close_and_replays_bitwise(cuda_engine):
    """The one-kernel-per-layer example (grid barriers between phases) on the shrunk preset:
    logits close to the reference's on the same inputs, K/V written only where the step
    owns, the same logits eagerly and from the captured graph, step after step (the barrier
    counters are fresh each call); batch > 1 runs the reference (bitwise), so the gate's
    batched steps match and its batch-1 steps are where it differs."""
    from engine_server.models import llama
    from engine_server.state import decode_batch
    src = example_source("llama_triton_persistent")
    r = cuda_engine.submit_forward_pass(src, name="persistent")
    assert r.ok and r.graphs, (r.error, r.notes)
    c = cuda_engine.candidates[r.candidate_id]
    st = cuda_engine.candidate_state(c)
    for pos in (0, 63, 300):
        b = decode_batch(torch.tensor([7], device="cuda"), torch.tensor([pos], device="cuda"),
                         torch.tensor([1], device="cuda"))
        assert c.module._supported(st, b)
        before = [k.clone() for k in st.k_cache]
        eager = c.forward(st, b).clone()
        for layer, (k0, k1) in enumerate(zip(before, st.k_cache)):
            changed = (k0 != k1).any(dim=-1).nonzero().tolist()  # [slot, head, pos] cells
            assert all(cell[0] == 1 and cell[2] == pos for cell in changed), (layer, changed[:4])
        assert torch.equal(eager, c.graphs.run(st, b).clone()) and torch.isfinite(eager).all()
        assert torch.equal(eager, c.forward(st, b))
        want = llama.forward(st, b).float()
        err = (eager.float() - want).abs().max().item()
        assert err <= 0.02 * want.abs().max().item(), (pos, err)
    b2 = decode_batch(torch.tensor([7, 9], device="cuda"), torch.tensor([40, 300], device="cuda"),
                      torch.tensor([1, 2], device="cuda"))
    assert not c.module._supported(st, b2)
    assert torch.equal(c.forward(st, b2), llama.forward(st, b2))
    ex = cuda_engine.check_bit_exact(r.candidate_id)
    assert not ex.exact and ex.first_mismatch.phase == "decode B=1", ex


def _bench(script: str, *argv: str) -> dict:
    """Run benchmarks/<script> with argv in a fresh process; its last line, the JSON result."""
    import json
    import subprocess
    import sys
    from conftest import ROOT
    out = subprocess.run([sys.executable, f"benchmarks/{script}", *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_smem_fill_bench_checks_every_program():
    """benchmarks/smem_fill_bench.py at two sizes: every method's every program read back the
    rows it was given (its sum against torch's), and its rate is a number (none asserted)."""
    res = _bench("smem_fill_bench.py", "--kib", "16,64", "--repeats", "2")
    assert sorted((r["method"], r["kib_per_program"]) for r in res["rows"]) == sorted(
        (m, k) for m in ("tma", "cp.async", "registers") for k in (16.0, 64.0))
    assert all(r["checked"] and r["us"] > 0 for r in res["rows"]), res["rows"]


def test_o_gate_up_in_one_kernel_keeps_the_step(cuda_engine):
    """The folded decode example with o_proj and gate_up in one Gluon kernel (bulk tensor
    copies into shared memory, a grid barrier): that kernel runs once a layer, and the logits
    are those of the two kernels it replaces within the atomics' flips, eager and from the
    graph; the tolerance gate passes with identical tokens."""
    base = example_source("llama_triton_decode", {"norm": {"FOLD": True}, "o_gate_up": {"FUSED": False}})
    one = example_source("llama_triton_decode", {"norm": {"FOLD": True}, "o_gate_up": {"FUSED": True}})
    ids = _same_logits(cuda_engine, {"o-gate-up-apart": base, "o-gate-up-one": one}, rel=2e-2)
    c = cuda_engine.candidates[ids[1]]
    calls = []
    inner = c.module._o_gate_up
    c.module._o_gate_up = lambda *a, **k: calls.append(1) or inner(*a, **k)
    try:
        from engine_server.state import decode_batch
        c.forward(cuda_engine.candidate_state(c), decode_batch(torch.tensor([5], device="cuda"),
                                                               torch.tensor([300], device="cuda"),
                                                               torch.tensor([0], device="cuda")))
    finally:
        c.module._o_gate_up = inner
    assert len(calls) == len(cuda_engine.candidate_state(c).layers), calls
    tol = cuda_engine.check_bit_exact(ids[1], mode="tolerance")
    assert tol.close and tol.tokens_equal, tol


class _Launches:
    """Stands in for a kernel (`kernel[grid](...)`), counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


def test_attention_in_one_cluster_keeps_the_step(cuda_engine):
    """The H200 winner with KNOBS["attn"]["CLUSTER"] (the attention and its combine as one Gluon
    kernel, a cluster of NSPLIT CTAs a kv head merging their partials after a cluster barrier),
    with 16 and 8 splits: that kernel runs once a layer, and the logits are those of the two
    kernels it replaces within the folded pass's last-bit flips, eager and from the graph."""
    from engine_server.state import decode_batch
    h200 = "llama_triton_decode_h200"
    ids = _same_logits(cuda_engine, {
        "attn-apart": example_source(h200, {"attn": {"NSPLIT": 16, "CLUSTER": False}}),
        "attn-cluster": example_source(h200, {"attn": {"NSPLIT": 16, "CLUSTER": True}}),
        "attn-cluster-8": example_source(h200, {"attn": {"NSPLIT": 8, "CLUSTER": True}})}, rel=2e-2)
    for cid in ids[1:]:
        c = cuda_engine.candidates[cid]
        st = cuda_engine.candidate_state(c)
        inner = c.module._attn_cluster_kernel
        c.module._attn_cluster_kernel = count = _Launches(inner)
        try:
            c.forward(st, decode_batch(torch.tensor([5], device="cuda"), torch.tensor([300], device="cuda"),
                                       torch.tensor([0], device="cuda")))
        finally:
            c.module._attn_cluster_kernel = inner
        assert count.n == len(st.layers), (cid, count.n)


def test_l2_copy_probe_checks_every_replay():
    """benchmarks/l2_copy_probe.py: every mode's graph replays computed the GEMV (and the copy)
    it times, for each weight shape; the times are numbers (none asserted)."""
    res = _bench("l2_copy_probe.py", "--reps", "3")
    assert len(res["shapes"]) == 3 and res["copy_runs_as"], res
    for name, shape in res["shapes"].items():
        for mode in ("none", "copy", "sum", "warm"):
            assert shape[mode]["checked"] and shape[mode]["replay_us"] > 0, (name, mode, shape[mode])


def test_greedy_sampler_with_pdl_and_advance_is_torch_argmax():
    """engine_server.greedy on CUDA: the Triton passes launched with programmatic dependent
    launch, and with the position's + 1 in their second kernel, give torch.argmax's indices
    (ties, NaN, a short last slice), eagerly; and in captured steps after a PDL-launched GEMV
    (benchmarks/greedy_bench.py --producer lm_head) every sampler picks the planted tie's first
    index and advances the position once a step. The times are numbers (none asserted)."""
    from test_greedy import _rows

    from engine_server import greedy
    assert greedy.pdl_capable(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    for V in (128256, 5000, 1100):
        for dtype in (torch.bfloat16, torch.float32):
            x = _rows(V, dtype).cuda()
            for pdl in (False, True) if greedy.pdl_capable(x.device) else (False,):
                pos = torch.tensor([[7], [0], [3], [9], [1]], device="cuda")
                got = greedy.argmax(x, impl="triton", pdl=pdl, advance=pos)
                assert torch.equal(got, torch.argmax(x, -1, keepdim=True)), (V, dtype, pdl)
                assert pos.view(-1).tolist() == [8, 1, 4, 10, 2], (V, dtype, pdl)
    res = _bench("greedy_bench.py", "--producer", "lm_head", "--replays", "50", "--repeats", "2")
    names = [r["sampler"] for r in res["results"]]
    pdl = ["triton, PDL", "triton, PDL + advance"] if greedy.pdl_capable(torch.device("cuda")) else []
    assert names == ["none", "torch.argmax", "triton, plain launches"] + pdl, names
    assert all(r["equal"] and r["advances"] and r["us"] > 0 for r in res["results"]), res["results"]


def test_attention_sums_divided_in_o_keep_the_step(cuda_engine):
    """The H200 winner with KNOBS["combine"]["IN_O"] (the attention splits add into the heads'
    sums, o_proj divides them as it loads: no combine kernel): the logits are those of the
    combine kernel's within the folded pass's last-bit flips, eager and from the graph, and no
    combine kernel runs; with one cached key scaled so its scores overflow the sums' weights,
    o_proj merges the splits' partials and the logits still are the combine kernel's."""
    from engine_server.state import decode_batch
    base = example_source("llama_triton_decode_h200", {"combine": {"IN_O": False}})
    on = example_source("llama_triton_decode_h200", {"combine": {"IN_O": True}})
    off_id, on_id = _same_logits(cuda_engine, {"combine-kernel": base, "sums-in-o": on}, rel=2e-2)
    b = decode_batch(torch.tensor([5], device="cuda"), torch.tensor([300], device="cuda"),
                     torch.tensor([0], device="cuda"))
    outs = []
    for cid, launches in ((off_id, None), (on_id, 0)):
        c = cuda_engine.candidates[cid]
        st = cuda_engine.candidate_state(c)
        inner = c.module._attn_combine_kernel
        c.module._attn_combine_kernel = count = _Launches(inner)
        saved = [kc[0, :, 3].clone() for kc in st.k_cache]
        try:
            c.forward(st, b)
            assert count.n == (len(st.layers) if launches is None else launches), (cid, count.n)
            for kc in st.k_cache:  # key 3 of slot 0, every kv head, a thousand times larger
                kc[0, :, 3] *= 1000
            outs.append(c.forward(st, b).float().clone())
        finally:
            c.module._attn_combine_kernel = inner
            for kc, s in zip(st.k_cache, saved):
                kc[0, :, 3] = s
    assert torch.isfinite(outs[1]).all()
    assert torch.allclose(outs[0], outs[1], rtol=2e-2, atol=2e-2 * outs[0].abs().max().item())
