"""The engine in-process: installs, failures as results, rollback, exactness, both tiers."""
import json
import random

import pytest
import torch

from engine_server import measure
from engine_server.config import ConfigError
from engine_server.engine import Engine, EngineConfig
from engine_server.selfcheck import perturbed_source, reference_source

from conftest import CHEATERS

GOOD = "from engine_server.models import llama as ref\n\ndef forward(state, batch):\n    return ref.forward(state, batch)\n"

BAD = {
    "syntax": ("def forward(state, batch)\n    return 1\n", "parse", "SyntaxError"),
    "import": ("import not_a_module_xyz\n", "import", "ModuleNotFoundError"),
    "no_forward": ("x = 1\n", "validate", "TypeError"),
    "signature": ("def forward(state):\n    return None\n", "validate", "TypeError"),
    "prepare_signature": (GOOD + "def prepare():\n    pass\n", "validate", "TypeError"),
    "raises": ("def forward(state, batch):\n    raise RuntimeError('boom')\n", "warmup", "RuntimeError"),
    "wrong_shape": ("import torch\ndef forward(state, batch):\n    return torch.zeros(3)\n", "warmup", "ValueError"),
    "float64": (GOOD.replace("ref.forward(state, batch)", "ref.forward(state, batch).double()"), "warmup",
                "TypeError"),
    "meta": (GOOD.replace("ref.forward(state, batch)", "ref.forward(state, batch).to('meta')"), "warmup",
             "TypeError"),
    "tensor_subclass": ("import torch\nfrom engine_server.models import llama as ref\n"
                        "class AlwaysEqual(torch.Tensor):\n    pass\n"
                        "def forward(state, batch):\n    return ref.forward(state, batch).as_subclass(AlwaysEqual)\n",
                        "warmup", "TypeError"),
    "exit": ("import sys\ndef forward(state, batch):\n    sys.exit(3)\n", "warmup", "RuntimeError"),
    "oom": (GOOD + "import torch\ndef prepare(state):\n    state.scratch['x'] = torch.empty(1 << 60)\n",
            "prepare", "RuntimeError"),
    "over_budget": (GOOD + "import torch\ndef prepare(state):\n    state.scratch['x'] = torch.zeros(1 << 27)\n",
                    "prepare", "MemoryError"),
    "hang": ("def forward(state, batch):\n    while True:\n        pass\n", "warmup", "TimeoutError"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_failures_are_results_and_the_next_candidate_installs(llama_engine, case):
    source, stage, err = BAD[case]
    llama_engine.config.call_timeout_s = 3 if case == "hang" else 20
    r = llama_engine.submit_forward_pass(source, name=case)
    llama_engine.config.call_timeout_s = 20
    assert not r.ok
    assert r.error.stage == stage, r.error
    assert r.error.type == err, r.error
    assert r.error.message
    assert r.candidate_id not in llama_engine.candidates
    good = llama_engine.submit_forward_pass(GOOD)
    assert good.ok, good.error
    assert llama_engine.check_bit_exact(good.candidate_id).exact
    assert llama_engine.weights_loaded == 1  # never a weight reload


def test_output_that_breaks_the_contract_on_wider_batches_is_the_candidates_failure(llama_engine):
    """Warm-up runs one row; a pass that returns one row whatever the batch installs, and every
    call that reads its output says so as its failure (stage "forward"), with no worker death."""
    src = GOOD.replace("return ref.forward(state, batch)", "return ref.forward(state, batch)[:1]")
    r = llama_engine.submit_forward_pass(src)
    assert r.ok, r.error
    cid = r.candidate_id
    for res in (llama_engine.check_bit_exact(cid), llama_engine.check_bit_exact(cid, mode="tolerance"),
                llama_engine.measure_fast(cid), llama_engine.measure_full(cid)):
        assert not res.ok and res.error.stage == "forward", res.error
        assert "shape (1, " in res.error.message and "rows" in res.error.message, res.error.message
    good = llama_engine.submit_forward_pass(GOOD)
    assert llama_engine.check_bit_exact(good.candidate_id).exact


def test_what_a_pass_does_to_its_state_containers_stays_in_its_view(llama_engine):
    """state.k_cache / tables / weights are the candidate's own containers (the tensors in them
    are shared): emptying them in prepare breaks nobody else."""
    src = GOOD + ("def prepare(state):\n    state.k_cache.pop()\n    state.v_cache.clear()\n"
                  "    state.tables.clear()\n    state.weights.popitem()\n")
    r = llama_engine.submit_forward_pass(src)
    assert r.ok, r.error
    assert llama_engine.check_bit_exact(r.candidate_id).exact
    assert llama_engine.measure_fast("reference").outputs_match == "bitwise"
    good = llama_engine.submit_forward_pass(GOOD)
    assert llama_engine.check_bit_exact(good.candidate_id).exact


def test_state_guard_puts_back_what_was_swapped_in_the_engines_state(llama_engine):
    eng = llama_engine
    cos, k0, layers = eng.state.tables["rope_cos"], eng.state.k_cache[0], eng.state.layers
    eng.state.tables["rope_cos"] = cos * 1.01
    eng.state.k_cache[0] = k0.clone()
    eng.state.layers = (0,)
    got = " | ".join(eng._guards())
    assert "state.layers" in got and "state.tables entries ['rope_cos']" in got and "state.k_cache" in got, got
    assert eng.state.tables["rope_cos"] is cos and eng.state.k_cache[0] is k0 and eng.state.layers == layers
    assert eng._guards() == []


def test_traceback_shows_candidate_lines(llama_engine):
    r = llama_engine.submit_forward_pass("def forward(state, batch):\n    raise KeyError('the_missing_key')\n")
    assert "the_missing_key" in r.error.traceback and "<candidate" in r.error.traceback


def test_nan_logits_are_not_exact(llama_engine):
    src = GOOD.replace("return ref.forward(state, batch)", "return ref.forward(state, batch) * float('nan')")
    r = llama_engine.submit_forward_pass(src)
    assert r.ok
    ex = llama_engine.check_bit_exact(r.candidate_id)
    assert not ex.exact and ex.first_mismatch is not None


def test_perturbed_names_first_mismatch_and_tolerance_never_exact(llama_engine):
    r = llama_engine.submit_forward_pass(perturbed_source(llama_engine, 1e-6))
    ex = llama_engine.check_bit_exact(r.candidate_id)
    assert not ex.exact and ex.first_mismatch.phase == "prefill" and 0 < ex.max_abs_diff < 1e-4
    tol = llama_engine.check_bit_exact(r.candidate_id, mode="tolerance")
    assert tol.close is True and tol.exact is False


def test_rollback_and_remove(llama_engine):
    r = llama_engine.submit_forward_pass(GOOD)
    assert llama_engine.rollback(r.candidate_id)["active"] == r.candidate_id
    assert llama_engine.rollback("reference")["active"] == "reference"
    assert not llama_engine.rollback("nope")["ok"]
    assert llama_engine.remove(r.candidate_id)["ok"]
    assert not llama_engine.measure_fast(r.candidate_id).ok


def test_fast_and_full_tier_results(llama_engine):
    r = llama_engine.submit_forward_pass(reference_source(llama_engine))
    fm = llama_engine.measure_fast(r.candidate_id)
    assert fm.ok and fm.valid and fm.outputs_match == "bitwise"
    assert fm.layers == list(llama_engine.fast_layers) and len(fm.layers) >= 1
    assert fm.shapes and all(s.step_ms > 0 for s in fm.shapes)
    assert fm.hardware.torch == torch.__version__
    full = llama_engine.measure_full(r.candidate_id)
    assert full.ok and full.valid and full.tokens_match == 1.0
    assert full.requests == llama_engine.config.full_requests
    for k in ("per_user_tps_p50", "per_user_tps_p90", "ttft_ms_p50", "ttft_ms_p90", "throughput_tps"):
        assert getattr(full, k) is not None and getattr(full, k) > 0, k
    assert full.speedup_ci95[0] <= full.speedup <= full.speedup_ci95[1]


def test_slower_candidate_is_measured_slower(llama_engine):
    slow = GOOD.replace("    return ref.forward(state, batch)",
                        "    for _ in range(3):\n        out = ref.forward(state, batch)\n    return out")
    r = llama_engine.submit_forward_pass(slow)
    fm = llama_engine.measure_fast(r.candidate_id)
    assert fm.valid and fm.speedup < 0.8, fm.speedup


def rounds_run(ratios, least, most, target):
    """How many rounds the fast tier runs on this sequence of paired ratios, and why it stops."""
    for n in range(1, len(ratios) + 1):
        why = measure.should_stop(ratios[:n], least, most, target)
        if why:
            return n, why
    raise AssertionError("the rule never stopped")


@pytest.mark.parametrize("centre", [2.0, 0.5])  # clearly faster, clearly slower
def test_sequential_stopping_stops_at_the_minimum_on_a_clear_measurement(centre):
    rng = random.Random(0)
    ratios = [centre * (1 + rng.gauss(0, 0.01)) for _ in range(21)]
    assert rounds_run(ratios, 9, 21, 0.05) == (9, "ci")


@pytest.mark.parametrize("centre", [1.0, 2.0])  # the interval's width decides, not its distance from 1
def test_sequential_stopping_runs_to_the_cap_when_noisy(centre):
    rng = random.Random(1)
    ratios = [centre * (1 + rng.gauss(0, 0.3)) for _ in range(21)]
    assert rounds_run(ratios, 9, 21, 0.05) == (21, "max_rounds")


def test_sequential_stopping_never_stops_below_the_minimum():
    same = [1.0] * 21  # an interval of width zero from the first round
    assert rounds_run(same, 9, 21, 0.05) == (9, "ci")
    assert rounds_run(same, 9, 21, 0.0) == (21, "max_rounds")  # target 0 (CUDA) or below: fixed rounds
    assert rounds_run(same, 9, 21, -1.0) == (21, "max_rounds")
    assert rounds_run(same, 30, 21, 0.05) == (21, "max_rounds")  # the cap wins over a larger minimum


def _depth_judged(first: float, again: float):
    """The depth check's verdict on one decode shape whose 5 check rounds gave the candidate
    `first` times the reference's ratio (1.0), and whose recheck rounds give it `again`."""
    name = "decode B=1 ctx=8"
    depth = {"ref": {name: [1.0] * 5}, "cand": {name: [first] * 5}}
    asked = []

    def recheck(shape, rounds):
        asked.append((shape, rounds))
        return {"ref": {shape: [1.0] * rounds}, "cand": {shape: [again] * rounds}}
    res = measure.MeasureResult(candidate_id="c", tier="fast", ok=True)
    measure._depth_check(type("Eng", (), {"cuda": False})(), res, depth, recheck)
    return res, asked


def test_depth_check_rechecks_a_failed_shape_before_it_flags_it():
    # within the slack: judged on the first rounds, nothing timed again
    res, asked = _depth_judged(first=1.2, again=9.0)
    assert not res.violations and not asked and res.config["depth_check"]["decode B=1 ctx=8"]["rechecked"] is False
    # a noisy first look (outside the slack) that the recheck does not confirm: no violation
    res, asked = _depth_judged(first=2.0, again=1.0)
    assert asked == [("decode B=1 ctx=8", 10)] and not res.violations, res.violations
    check = res.config["depth_check"]["decode B=1 ctx=8"]
    assert check["rechecked"] is True and check["repetitions"] == 15 and check["cand"] == 1.0, check
    # padding shows in every round: the recheck confirms it
    res, asked = _depth_judged(first=3.0, again=3.0)
    assert asked and any("grow with the layers" in v for v in res.violations), res.violations


def _estimate_judged(first: float, again: float, depth_rechecked: bool = False):
    """The estimate check's verdict on one decode shape whose speedup is 2.0 in every round,
    and whose speedup at full depth is 2.0 / `first` in its 3 check rounds and 2.0 / `again`
    in the rounds a recheck adds (the reference's full depth over its extrapolation: 1.0)."""
    name = "decode B=1 ctx=8"
    res = measure.MeasureResult(candidate_id="c", tier="fast", ok=True)
    res.config["depth_check"] = {name: {"ref": 1.0, "cand": 1.0, "rechecked": depth_rechecked}}
    asked = []

    def recheck(shape, rounds):
        asked.append((shape, rounds))
        return [2.0 / again] * rounds
    measure._estimate_check(type("Eng", (), {"cuda": False})(), res, {name: [2.0 / first] * 3},
                            {name: [2.0] * 12}, recheck)
    return res, asked, res.config["depth_check"][name]


def test_estimate_check_rechecks_a_failed_shape_before_it_flags_it():
    # within the slack (1.4 on the CPU): nothing timed again
    res, asked, check = _estimate_judged(first=1.3, again=9.0)
    assert not res.violations and not asked and check["estimate_rechecked"] is False, check
    assert check["cand_over_estimate"] == pytest.approx(1.3)
    # a few noisy check rounds that the recheck does not confirm: no violation
    res, asked, check = _estimate_judged(first=1.6, again=1.0)
    assert asked == [("decode B=1 ctx=8", 6)] and not res.violations, res.violations
    assert check["estimate_rechecked"] is True and check["first_cand_over_estimate"] == pytest.approx(1.6)
    assert check["cand_over_estimate"] == pytest.approx(1.0)
    # rounds faster than full depth show in the recheck too: flagged
    res, asked, check = _estimate_judged(first=2.5, again=2.5)
    assert asked and any("rests on" in v for v in res.violations), res.violations
    # the depth check's recheck already gave these rounds: judged on them, not timed again
    res, asked, check = _estimate_judged(first=2.5, again=1.0, depth_rechecked=True)
    assert not asked and any("rests on" in v for v in res.violations), res.violations


# a correct pass whose first full-depth batch-1 decode steps are slow (as a noisy spell of the
# machine would make them); `armed` is set by the test
FIRST_LOOK_SLOW = """
from engine_server.models import llama as ref

armed = [0]  # full-depth batch-1 decode steps still to slow down


def forward(state, batch):
    repeat = 1
    if armed[0] > 0 and len(state.layers) == state.config.num_layers and batch.size == 1 and batch.seq_len == 1:
        armed[0] -= 1
        repeat = 8
    for _ in range(repeat):
        out = ref.forward(state, batch)
    return out
"""


def test_depth_check_recheck_clears_a_slow_first_look(llama_engine):
    """The engine's own recheck: the first look's full-depth steps run 8x slow, the recheck's at
    speed; the pass is valid and says it was rechecked. (The rounds are fixed at DEPTH_REPS, so
    every round is a check round and the first look's steps, the warm-up rounds' included, can
    be counted.)"""
    r = llama_engine.submit_forward_pass(FIRST_LOOK_SLOW)
    assert r.ok, r.error
    cfg = llama_engine.config
    saved = cfg.fast_rounds, cfg.fast_min_rounds
    try:
        cfg.fast_rounds = cfg.fast_min_rounds = measure.DEPTH_REPS["cpu"]
        armed = llama_engine.candidates[r.candidate_id].module.armed
        # the first look's steps: the warm-up rounds draw check rounds too
        armed[0] = (cfg.warmup_rounds + measure.DEPTH_REPS["cpu"]) * cfg.fast_iters
        fm = llama_engine.measure_fast(r.candidate_id)
    finally:
        cfg.fast_rounds, cfg.fast_min_rounds = saved
    check = fm.config["depth_check"][fm.shapes[0].shape]
    assert armed[0] == 0 and check["rechecked"] is True and check["repetitions"] == 9, check
    assert fm.valid, (fm.violations, check)


def test_depth_check_rounds_are_drawn_at_random(llama_engine):
    """Each timed round is a check round with the chance DEPTH_REPS / fast_min_rounds (1/3 on
    the CPU), at least DEPTH_REPS of them a call; a reference copy stays valid."""
    r = llama_engine.submit_forward_pass(reference_source(llama_engine))
    sh = llama_engine.fast_setup.shapes[0]
    assert measure._depth_odds(llama_engine, sh) == pytest.approx(
        measure.DEPTH_REPS["cpu"] / llama_engine.config.fast_min_rounds)
    for _ in range(2):
        fm = llama_engine.measure_fast(r.candidate_id)
        assert fm.valid, fm.violations
        check = fm.config["depth_check"][fm.shapes[0].shape]
        assert check["repetitions"] >= measure.DEPTH_REPS["cpu"] * (1 + 2 * check["rechecked"]), check


def test_depth_check_first_look_pools_the_reference_recheck_does_not():
    """The first look judges the candidate against the reference's earlier ratios and this
    call's; a recheck against the reference's fresh ratios alone."""
    name = "decode B=1 ctx=8"
    res = measure.MeasureResult(candidate_id="c", tier="fast", ok=True)
    eng = type("Eng", (), {"cuda": False})()
    # the pool's ratios (about 1.0) outvote this call's one high reference ratio: 1.5 is outside
    # the slack of the pooled median, though inside that of the call's own (2.0)
    fresh_ratios = {"ref": {name: [2.0]}, "cand": {name: [1.5] * 3}}
    asked = []

    def recheck(shape, rounds):
        asked.append(rounds)
        return {"ref": {shape: [1.1] * rounds}, "cand": {shape: [1.0] * rounds}}
    measure._depth_check(eng, res, fresh_ratios, recheck, pool={name: [1.0] * 9})
    check = res.config["depth_check"][name]
    assert asked == [6] and not res.violations, res.violations
    assert check["reference_pooled"] == 9 and check["reference_fresh"] == [2.0] + [1.1] * 6, check
    assert (check["ref"], check["cand"]) == (1.1, 1.0), check  # the recheck's fresh rounds only


def test_reference_depth_pool_fills_from_passing_calls_and_still_catches_padding():
    """Calls that pass fill the reference's depth pool; once it holds twice a shape's fewest
    check rounds, the reference times that shape at full depth once a call and the first look
    uses the pool. A call that fails adds nothing, and a depth padder is still caught."""
    eng = Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu", call_timeout_s=20))
    pool = eng.fast_setup.ref_depth
    good = eng.submit_forward_pass(reference_source(eng)).candidate_id
    fm = eng.measure_fast(good)
    assert fm.valid, fm.violations
    first = fm.config["depth_check"]
    assert set(first) == set(pool) and all(c["reference_pooled"] == 0 for c in first.values()), first
    # unpooled: the reference timed every check round the candidate did
    assert all(len(c["reference_fresh"]) == c["repetitions"] for c in first.values()), first
    assert all(pool[n] == first[n]["reference_fresh"] for n in pool), (pool, first)
    least = {sh.name: measure._depth_least(eng, sh) for sh in eng.fast_setup.shapes}
    while any(len(pool[n]) < 2 * least[n] for n in pool):
        assert eng.measure_fast(good).valid
    before = {n: list(xs) for n, xs in pool.items()}
    fm = eng.measure_fast(good)
    assert fm.valid, fm.violations
    for n, c in fm.config["depth_check"].items():
        assert c["reference_pooled"] == len(before[n]) > 0, c
        if not c["rechecked"]:
            assert len(c["reference_fresh"]) == 1, c  # one full-depth timing of the reference a call
        assert pool[n] == (before[n] + c["reference_fresh"])[-measure.DEPTH_POOL:]
    before = {n: list(xs) for n, xs in pool.items()}
    padder = eng.submit_forward_pass((CHEATERS / "depth_padder.py").read_text()).candidate_id
    fm = eng.measure_fast(padder)
    assert not fm.valid and any("grow with the layers" in v for v in fm.violations), fm.violations
    assert any(c["reference_pooled"] > 0 for c in fm.config["depth_check"].values()), fm.config["depth_check"]
    assert pool == before  # a call that failed adds nothing to the pool
    # the reference's timed outputs, kept from its first call, are what it computes now
    setup, ref = eng.fast_setup, eng.candidates["reference"]
    shapes = {sh.name: sh for sh in setup.shapes}
    depths = {"k": eng.fast_layers, "0": ()}
    assert {d for d, _ in setup.ref_outputs} == set(depths) and set(shapes) == {n for _, n in setup.ref_outputs}
    for (d, name), kept in setup.ref_outputs.items():
        eng.state.load_cache(*setup.kv)
        out, _ = measure.run_step(eng, ref, eng.candidate_state(ref, depths[d]), shapes[name].batch)
        assert torch.equal(out, kept), (d, name)


# a reference copy that logs the depth (layers run) and tokens of every call
DEPTH_LOGGER = """
from engine_server.models import llama as ref

CALLS = []


def forward(state, batch):
    CALLS.append((len(state.layers), batch.seq_len))
    return ref.forward(state, batch)
"""


def test_warm_up_rounds_are_drawn_as_check_rounds_too(llama_engine):
    """A pass that pads until it has seen a full-depth step (tests/cheaters/depth_counter.py
    when only its prefill is eager, as under CUDA graphs) must not get the first timed rounds
    for free: the warm-up rounds draw check rounds as the timed ones do (here every round:
    odds 1 with fast_min_rounds = DEPTH_REPS), so a full-depth step comes in the first round."""
    eng, cfg = llama_engine, llama_engine.config
    r = eng.submit_forward_pass(DEPTH_LOGGER)
    calls = eng.candidates[r.candidate_id].module.CALLS
    L, k = len(eng.state.layers), len(eng.fast_layers)
    saved = cfg.fast_min_rounds
    try:
        cfg.fast_min_rounds = measure.DEPTH_REPS["cpu"]
        calls.clear()
        fm = eng.measure_fast(r.candidate_id)
    finally:
        cfg.fast_min_rounds = saved
    assert fm.valid, fm.violations
    assert cfg.warmup_rounds >= 1
    # the first round: each shape's fast-layer and no-layer steps, the checked ones' full depth
    prefill_k = [i for i, (n, t) in enumerate(calls) if n == k and t > 1]
    first_full = next(i for i, (n, _) in enumerate(calls) if n == L)
    assert first_full < prefill_k[1], calls[:prefill_k[1] + 1]


def test_estimate_check_is_not_moved_by_a_machine_slow_in_the_check_rounds(llama_engine, monkeypatch):
    """A 3x slower honest pass on a machine that runs 1.8x slow in every check round (as a
    loaded host can): the speedup and the speedup at full depth are each paired within rounds,
    so the estimate check sees the pass's true 1.0 and it stays valid. (Judged across rounds,
    full depth over the median estimate was 1.8, outside the CPU's slack of 1.4. The timings
    are synthetic: each is (1 + layers) times the side's cost, patched in after the install.)"""
    eng = llama_engine
    L, k = len(eng.state.layers), len(eng.fast_layers)
    layers = {"0": 0, "k": k, "L": L}
    real = measure._timed_round

    def timed(*args, **kw):
        got = real(*args, **kw)
        slow = 1.8 if any(d == "L" for d, _ in got["cand"]) else 1.0
        return {s: {(d, n): slow * (3.0 if s == "cand" else 1.0) * 1e-3 * (1 + layers[d]) for d, n in t}
                for s, t in got.items()}
    r = eng.submit_forward_pass(GOOD)
    assert r.ok, r.error
    monkeypatch.setattr(measure, "_timed_round", timed)
    fm = eng.measure_fast(r.candidate_id)
    assert fm.ok, fm.error
    check = fm.config["depth_check"][fm.shapes[0].shape]
    assert check["cand_over_estimate"] == pytest.approx(1.0), check
    # the engine's guard sees the patch (the only violation it may add); nothing else is flagged
    rest = [v for v in fm.violations if "measure._timed_round was replaced" not in v]
    assert not rest and fm.speedup == pytest.approx(1 / 3), (fm.violations, check)


# a reference copy that logs the depth, batch rows and tokens of every call
SHAPE_LOGGER = """
from engine_server.models import llama as ref

CALLS = []


def forward(state, batch):
    CALLS.append((len(state.layers), batch.size, batch.seq_len))
    return ref.forward(state, batch)
"""


def test_decode_steps_per_timing_follow_the_shapes_weights(llama_engine):
    """The heaviest decode shape is timed with fast_iters steps, a lighter one in proportion to
    its weight (at least one): on the CPU preset the wide shape (6 of the replay's 63 decode ops)
    takes one step a timing to the batch-1 shape's three, as the pass itself sees."""
    eng, cfg = llama_engine, llama_engine.config
    r = eng.submit_forward_pass(SHAPE_LOGGER)
    calls = eng.candidates[r.candidate_id].module.CALLS
    calls.clear()
    fm = eng.measure_fast(r.candidate_id)
    assert fm.valid, fm.violations
    weights, iters = fm.config["weights"], fm.config["shape_iters"]
    decode = {s.shape: s.batch for s in fm.shapes if not s.shape.startswith("prefill")}
    top = max(weights[n] for n in decode)
    assert iters == {n: (max(1, round(cfg.fast_iters * weights[n] / top)) if n in decode else 1) for n in weights}
    one, wide = (next(n for n, b in decode.items() if b == size) for size in (1, 2))
    assert (iters[one], iters[wide]) == (cfg.fast_iters, 1), iters
    # fast-layer steps seen: each timing's steps in every round, and one more in the output check
    k = len(eng.fast_layers)
    seen = {size: sum(1 for c in calls if c == (k, size, 1)) - 1 for size in (1, 2)}
    assert seen[1] == cfg.fast_iters * seen[2] > 0, seen


def test_fast_tier_reports_the_rounds_it_ran_and_why(llama_engine):
    r = llama_engine.submit_forward_pass(reference_source(llama_engine))
    cfg = llama_engine.config
    saved = cfg.fast_rounds, cfg.fast_min_rounds, cfg.fast_ci
    try:
        cfg.fast_rounds, cfg.fast_min_rounds, cfg.fast_ci = 7, 4, 10.0  # any interval is narrow enough
        fm = llama_engine.measure_fast(r.candidate_id)
        assert fm.valid and fm.samples == 4 and fm.config["stopped"]["why"] == "ci", fm.config
        cfg.fast_ci = 1e-9  # none is
        fm = llama_engine.measure_fast(r.candidate_id)
        assert fm.valid and fm.samples == 7 and fm.config["stopped"]["why"] == "max_rounds", fm.config
        lo, hi = fm.speedup_ci95
        assert lo <= fm.speedup <= hi
        assert fm.config["stopped"]["ci_half_width"] == pytest.approx((hi - lo) / 2 / fm.speedup, abs=1e-4)
    finally:
        cfg.fast_rounds, cfg.fast_min_rounds, cfg.fast_ci = saved


def test_sequential_stopping_defaults_per_device():
    cpu, cuda = EngineConfig(device="cpu").resolved(), EngineConfig(device="cuda").resolved()
    assert (cpu.fast_rounds, cpu.fast_min_rounds, cpu.fast_ci) == (21, 9, 0.05)
    # one warm-up round on the CPU, two on CUDA; 0 (none) is kept as asked
    assert (cpu.warmup_rounds, cuda.warmup_rounds) == (1, 2)
    assert EngineConfig(device="cpu", warmup_rounds=0).resolved().warmup_rounds == 0
    # CUDA timings are steady: +-1% after at least 5 rounds, 15 at most
    assert (cuda.fast_rounds, cuda.fast_min_rounds, cuda.fast_ci) == (15, 5, 0.01)
    off = EngineConfig(device="cuda", fast_ci=-1.0).resolved()
    assert off.fast_ci < 0
    assert measure.should_stop([1.0] * 14, off.fast_min_rounds, off.fast_rounds, off.fast_ci) is None


def test_fast_tier_says_where_its_seconds_go(llama_engine):
    r = llama_engine.submit_forward_pass(reference_source(llama_engine))
    fm = llama_engine.measure_fast(r.candidate_id)
    ph = fm.config["phases_s"]
    parts = ("setup", "rounds_decode", "rounds_prefill", "outputs", "depth_check")
    assert set(ph) == set(parts) | {"total", "guards"}, ph  # guards: the engine's checks after the call
    assert all(ph[k] > 0 for k in parts if k != "setup") and ph["setup"] >= 0, ph
    # the parts are disjoint spans of the call: they add up to no more than it took
    assert sum(ph[k] for k in parts) <= ph["total"] + 1e-3, ph
    assert ph["total"] + ph["guards"] <= fm.seconds + 1e-3, (ph, fm.seconds)


# tests/cheaters/depth_padder.py, padding the prefill only
PREFILL_PADDER = """
import dataclasses

from engine_server.models import llama as ref


def forward(state, batch):
    if not state.layers and batch.seq_len > 1:  # the no-layer prefill runs a layer, thrown away
        ref.forward(dataclasses.replace(state, layers=(0,)), batch)
    return ref.forward(state, batch)
"""


def test_fast_prefill_layers_extrapolates_and_depth_checks_the_prefill(llama_engine):
    cfg = llama_engine.config
    assert cfg.fast_prefill == "layers"  # the default
    copy = llama_engine.submit_forward_pass(reference_source(llama_engine))
    pad = llama_engine.submit_forward_pass(PREFILL_PADDER)
    assert copy.ok and pad.ok
    fm = llama_engine.measure_fast(copy.candidate_id)
    assert fm.valid, fm.violations
    prefill = next(s.shape for s in fm.shapes if s.shape.startswith("prefill"))
    assert set(fm.config["depth_check"]) == {fm.shapes[0].shape, prefill}, fm.config["depth_check"]
    assert fm.config["prefill"] == "layers" and fm.config["phases_s"]["rounds_prefill"] > 0
    # padding the no-layer prefill would shrink its extrapolated time: the prefill's own
    # full-depth timing gives it away
    fm = llama_engine.measure_fast(pad.candidate_id)
    assert not fm.valid and any(prefill in v and "grow with the layers" in v for v in fm.violations), fm.violations
    try:
        cfg.fast_prefill = "full"  # the prefill timed at full depth: nothing to pad, nothing more to check
        fm = llama_engine.measure_fast(copy.candidate_id)
        assert fm.valid and list(fm.config["depth_check"]) == [fm.shapes[0].shape], fm.config
        assert fm.config["prefill"] == "full"
    finally:
        cfg.fast_prefill = "layers"
    assert EngineConfig(device="cuda").resolved().fast_prefill == "layers"
    with pytest.raises(ConfigError, match="fast_prefill"):
        EngineConfig(fast_prefill="half").resolved()


def test_fast_layers_spread_from_first_to_last():
    from engine_server.engine import fast_layers
    assert fast_layers(16, 0.2) == (0, 8, 15)
    assert fast_layers(4, 0.2) == (2,) and fast_layers(1, 0.2) == (0,)
    assert fast_layers(4, 1.0) == (0, 1, 2, 3) and fast_layers(4, 3.0) == (0, 1, 2, 3)
    # at least `least` layers: CUDA's default two (a lone layer is a poor slope where kernels overlap)
    assert fast_layers(4, 0.2, 2) == (0, 3) and fast_layers(16, 0.2, 2) == (0, 8, 15) and fast_layers(1, 0.2, 2) == (0,)
    assert EngineConfig(device="cuda").resolved().fast_min_layers == 2
    assert EngineConfig(device="cpu").resolved().fast_min_layers == 1
    assert EngineConfig(device="cuda", fast_min_layers=1).resolved().fast_min_layers == 1


def test_fast_fraction_one_times_every_shape_at_full_depth(llama_engine):
    """With all layers as the fast layers nothing is extrapolated: every shape is timed at
    full depth, with no no-layer timings and no depth check."""
    from engine_server.engine import fast_layers
    eng = llama_engine
    saved = eng.fast_layers
    L = len(eng.state.layers)
    copy = eng.submit_forward_pass(reference_source(eng))
    assert copy.ok
    try:
        eng.fast_layers = fast_layers(L, 1.0)
        fm = eng.measure_fast(copy.candidate_id)
    finally:
        eng.fast_layers = saved
    assert fm.valid, fm.violations
    assert fm.layers == list(range(L)) and fm.config["depth_check"] == {}
    assert fm.config["depth"] == "every shape at all layers" and fm.config["phases_s"]["rounds_prefill"] > 0
    assert {s.shape.split()[0] for s in fm.shapes} == {"decode", "prefill"}


def test_prepare_scratch_is_counted_and_usable(llama_engine):
    src = ("import torch\nfrom engine_server.models import llama as ref\n"
           "def prepare(state):\n    state.scratch['ones'] = torch.ones(1000)\n"
           "def forward(state, batch):\n    assert state.scratch['ones'].sum() == 1000\n"
           "    return ref.forward(state, batch)\n")
    r = llama_engine.submit_forward_pass(src)
    assert r.ok and r.prepare_bytes >= 4000
    assert llama_engine.check_bit_exact(r.candidate_id).exact


def test_read_engine_source_stays_in_snapshot(llama_engine):
    listing = llama_engine.read_engine_source()
    assert listing["reference_forward"] == "engine_server/models/llama.py"
    assert any(f["path"] == "engine_server/models/llama.py" for f in listing["files"])
    text = llama_engine.read_engine_source("engine_server/models/llama.py", 1, 5)
    assert text["ok"] and text["text"].lstrip().startswith("1")
    for bad in ("../pyproject.toml", "/etc/passwd", "engine_server/../../README.md"):
        assert not llama_engine.read_engine_source(bad)["ok"]


def test_safetensors_directory_gives_same_logits(tmp_path):
    from engine_server.weights import save_weights
    mem = Engine(EngineConfig(model="qwen2.5-0.5b", shrink=True))
    save_weights(mem.state.weights, mem.model, tmp_path / "m", max_shard_bytes=400_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    disk = Engine(EngineConfig(model=str(tmp_path / "m")))
    assert disk.weights_source == str(tmp_path / "m")
    from engine_server.state import prefill_batch
    toks = torch.tensor([mem.traffic.tokens(16, 0)])
    a = mem.family.forward(mem.state, prefill_batch(toks, torch.tensor([0])))
    b = disk.family.forward(disk.state, prefill_batch(toks, torch.tensor([0])))
    assert torch.equal(a, b)


def test_selfcheck_cli_prints_json_last(capsys):
    from tkcc_mcp.cli import main
    assert main(["engine", "selfcheck", "--model", "gpt2", "--shrink", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["model_type"] == "gpt2" and report["exact_reference"] and not report["exact_perturbed"]
    assert isinstance(report["speedup_fast"], float)


def test_depth_check_bench_reports_each_setting(tmp_path):
    """benchmarks/depth_check_bench.py: a row per setting, the padders it runs all caught."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/depth_check_bench.py", "--shrink", "--device", "cpu",
                          "--n", "2", "--reps", "3,2", "1,1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(s["decode_rounds"], s["prefill_rounds"]) for s in res["settings"]] == [(3, 2), (1, 1)]
    for s in res["settings"]:
        assert len(s["copies_relative"]) == 2 and s["padders"] == 1, s
        assert s["padders_caught"] == 1 and min(s["padders_relative"]) > res["slack"], s
        assert 0 < s["depth_check_s_p50"] < s["fast_s_p50"], s
        # the estimate check's ratio for each run, and the slow honest copy measured beside them
        assert len(s["copies_estimate"]) == 2 and len(s["files"]["slow3"]["estimate"]) == 2, s
        assert all(x > 0 for x in s["copies_estimate"] + s["padders_estimate"]), s


def test_cheater_trace_logs_what_the_cheater_sees(tmp_path):
    """benchmarks/cheater_trace.py: on the CPU the counting cheater sees every call, pads the
    no-layer steps it thinks unchecked, and is caught; its trace holds those calls."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/cheater_trace.py", "--shrink", "--device", "cpu", "--n", "1",
                          "depth_counter"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run, = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    assert run["exact"] and not run["valid"] and not run["graphs"], run
    trace = run["trace"]
    assert run["padded_decodes"] > 0 and "Ld" in trace and ("0p" in trace or "Pp" in trace), trace[:200]
    # its rounds' median estimate against its full depth: caught also when its check rounds
    # came right after others and looked honest (the depth check alone then let it pass)
    assert any("rests on" in v for v in run["violations"]), run["violations"]
    bad = subprocess.run([sys.executable, "benchmarks/cheater_trace.py", "--device", "cpu", "README.md"], cwd=root,
                         capture_output=True, text=True, timeout=60)  # not a cheater: a usage error, no engine
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and "depth_counter" in bad.stderr, bad.stderr


def test_round_noise_bench_reports_every_timing_and_estimate(tmp_path):
    """benchmarks/round_noise_bench.py: every round kept, a spread per timing, five estimates'
    spreads and three intervals at each round count asked for."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/round_noise_bench.py", "--shrink", "--device", "cpu",
                          "--n", "3", "--rounds", "4", "--at", "2,4"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(res["weights"])
    assert sorted(res["timings_log_ratio"]) == sorted(f"{d}|{n}" for n in names for d in "k0")
    assert list(res["estimate_log_spread"]) == ["2", "4"]
    for row in res["estimate_log_spread"].values():
        assert set(row) == {"median_of_rounds", "per_timing_medians", "hodges_lehmann", "trimmed_mean_of_rounds",
                            "median_of_pairs"}
        assert min(row.values()) >= 0
    for n, row in res["interval"].items():
        assert set(row) == {"median_of_rounds", "trimmed_mean_of_rounds", "median_of_pairs"}
        assert all(0 <= v["would_stop"] <= 3 for v in row.values()), row
        # at 2 rounds there is one pair: an interval of no width
        assert all(v["half_width_mean"] > 0 for k, v in row.items() if k != "median_of_pairs" or n == "4"), row
    assert res["call_s_p50"] > 0 and isinstance(res["copies_flagged"], list)
    assert set(res["log_ratio_by_round"]) == {"round"} | set(res["timings_log_ratio"])
    assert all(len(xs) == 4 for xs in res["log_ratio_by_round"].values()), res["log_ratio_by_round"]


def test_kernel_resources_reads_each_decode_kernel_compiled_for_sm90():
    """benchmarks/kernel_resources.py on the H200 winner (shrunk preset): every kernel of the
    step compiled for sm_90 with its registers, shared memory (the launch's dynamic share too)
    and residency; a KNOBS override reaches the compile (gate_up on 4 warps instead of 8; down's
    K loop pipelined through shared memory)."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    res = []
    for over in ("{}", '{"gate_up": {"num_warps": 4}}'):
        out = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--shrink", "--set", over,
                              "examples/candidates/llama_triton_decode_h200.py"], cwd=root, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        res.append({r["kernel"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["kernels"]})
    base, four = res
    assert set(base) == {"_add_norm_kernel", "qkv", "_attn_kernel", "_attn_combine_kernel", "o", "gate_up", "down",
                         "lm_head"}, set(base)
    for r in base.values():
        assert 0 < r["regs"] <= 255 and r["per_sm"] >= 1 and r["register_file_share"] > 0, r
        assert r["per_sm"] == min(r["per_sm_by_registers"], r["per_sm_by_warps"], r["per_sm_by_shared"], 32), r
    assert base["gate_up"]["warps"] == 8 and four["gate_up"]["warps"] == 4
    assert four["qkv"] == base["qkv"]
    # the launch's dynamic shared memory counts: the attention's K/V tiles, a pipelined K loop's stages
    assert base["_attn_kernel"]["shared"] > 1024 and base["_attn_kernel"]["per_sm_by_shared"] < 233472 // 1024
    piped = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--shrink", "--set",
                            '{"down": {"LOOP_STAGES": 3}}', "examples/candidates/llama_triton_decode_h200.py"],
                           cwd=root, capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr[-3000:]
    down = {r["kernel"]: r for r in json.loads(piped.stdout.strip().splitlines()[-1])["kernels"]}["down"]
    assert down["shared"] > base["down"]["shared"] and down["per_sm_by_shared"] < base["down"]["per_sm_by_shared"]


def test_cycle_bench_runs_on_the_cpu_and_records_the_hosts_speed():
    """benchmarks/cycle_bench.py end to end on the shrunk preset: live and restart cycles, both
    tiers' seconds, and this host's speed at its start and end (`host_speed`, with the reference
    decode step outside the engine: CPU cycles compare across hours only beside it), in the card
    and the JSON (no timing is asserted)."""
    import math
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from benchmarks.common import host_line, host_speed
    threads = torch.get_num_threads()
    h = host_speed(repeats=2, steps=20)
    assert torch.get_num_threads() == threads  # its one thread given back
    assert set(h) == {"python_loop_ns", "torch_op_us", "decode_step_ms"}
    assert all(math.isfinite(v) and v > 0 for v in h.values()), h
    assert host_line({"start": h, "end": h}).startswith("this host, start / end: a Python loop iteration ")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/cycle_bench.py", "--device", "cpu", "--shrink", "--n", "2",
                          "--full", "1"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert len(res["live_s"]["all"]) == 2 and len(res["restart_s"]["all"]) == 2
    assert res["ratio_p50"] > 0 and res["full_over_fast"] > 0
    assert all(x["rounds"] >= 1 and x["fast_s"] > 0 for x in res["live_inside_engine"])
    assert set(res["host_speed"]) == {"start", "end"}
    assert all(v > 0 for r in res["host_speed"].values() for v in r.values())
    assert host_line(res["host_speed"]) in lines


def test_smem_fill_bench_kernels_compile_for_sm90():
    """benchmarks/smem_fill_bench.py's kernels compiled for sm_90 without a GPU: the TMA program
    issues one bulk tensor copy a step and the cp.async one two 16-byte copies a thread a step
    (32 rows of 64 bf16 columns on 128 threads), at the smallest and the largest size."""
    pytest.importorskip("triton")
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("smem_fill_bench", root / "benchmarks" / "smem_fill_bench.py")
    fb = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(fb)
    except SystemExit as e:  # a Triton without Gluon
        pytest.skip(str(e))
    from benchmarks.kernel_resources import compile_sm90
    w, out = torch.zeros(256, fb.K, dtype=torch.bfloat16), torch.zeros(132)
    desc = fb.EX._gl_desc(w, [fb.ROWS, fb.BLOCK_K])
    for steps in (4, 48):
        kw = dict(BLOCK_N=fb.ROWS, BLOCK_K=fb.BLOCK_K, STEPS=steps, NW=4, num_warps=4)
        tma = compile_sm90(fb._fill_tma, (desc, out, 0), kw).asm["ptx"]
        assert tma.count("cp.async.bulk.tensor") == steps
        cp = compile_sm90(fb._fill_async, (w, out, 0, fb.K), kw).asm["ptx"]
        assert cp.count("cp.async.cg.shared.global") + cp.count("cp.async.ca.shared.global") == 2 * steps
        regs = compile_sm90(fb._fill_regs, (w, out, 0, fb.K), dict(BLOCK_N=fb.ROWS, BLOCK_K=fb.REG_K,
                                                                    STEPS=steps * fb.BLOCK_K // fb.REG_K,
                                                                    num_warps=4, num_stages=4))
        assert regs.asm.get("cubin")


def test_vllm_cycle_bench_waits_for_what_an_experiment_left_running():
    """benchmarks/vllm_cycle_bench.py: after a restart-workflow experiment's process exits, the
    next experiment waits until every process of its session has gone too (a child still
    running would slow the live engine's experiment that follows)."""
    import subprocess
    from benchmarks.vllm_cycle_bench import _wait_session_gone
    p = subprocess.Popen(["bash", "-c", "(sleep 0.5 &); exit 0"], start_new_session=True)
    p.wait()
    assert _wait_session_gone(p.pid) >= 0.3  # the orphaned sleep, after its parent exited
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    assert _wait_session_gone(p.pid) < 0.3


def test_fidelity_bench_ranks_honest_candidates_on_both_tiers():
    """benchmarks/fidelity_bench.py: every candidate (the agent's moves and the hand-written
    ones, all honest) measured on both tiers, a Spearman coefficient, and which of them a
    tier flagged, with why (no timing is asserted: this host's noise decides them)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "benchmarks/fidelity_bench.py", "--device", "cpu", "--shrink",
                          "--moves", "1", "--full-requests", "4"], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    names = [r["name"] for r in res["rows"]]
    assert len(names) >= 16 and any(n.startswith("layer-work") for n in names), names
    assert -1.0 <= res["spearman"] <= 1.0
    assert all(r["fast"] > 0 and r["full"] > 0 for r in res["rows"]), res["rows"]
    assert res["flagged"] == [r["name"] for r in res["rows"] if not (r["fast_valid"] and r["full_valid"])]
    assert all(isinstance(r["violations"], list) for r in res["rows"])
