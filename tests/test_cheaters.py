"""Every candidate in tests/cheaters/ must be caught, and the engine must stay usable."""
import pytest

from conftest import CHEATERS
from engine_server.selfcheck import reference_source

CHEATS = sorted(p.stem for p in CHEATERS.glob("*.py"))
EXPECT = {  # a word the violation or error must contain: it names what the cheater did
    "weight_writer": "wrote to weight",
    "stale_results": "kept from an earlier call",
    "layer_skipper": "state.layers",
    "kv_outside": "outside its cache cells",
    "side_stream": "unsynchronised",
    "timer_patch": "perf_counter",
    "depth_padder": "grow with the layers",
    "depth_counter": "grow with the layers",
    "batch1_shortcut": "batch-1 decode",
    "table_swapper": "inspected the engine's process: gc.get_objects",
    "frame_walker": "inspected the engine's process: sys._getframe",
    "function_patch": "torch.nn.functional.linear was replaced",
    "gil_hog": "left a thread running its code",
}


def verdict(eng, source):
    r = eng.submit_forward_pass(source, name="cheater")
    if not r.ok:
        return False, r.error.message, None, None
    ex = eng.check_bit_exact(r.candidate_id)
    fm = eng.measure_fast(r.candidate_id)
    text = " | ".join(ex.violations + fm.violations)
    return ex.exact and fm.valid, text, ex, fm


def test_every_cheater_has_an_expectation():
    assert set(CHEATS) == set(EXPECT)


@pytest.mark.parametrize("name", CHEATS)
def test_cheater_is_caught(llama_engine, name):
    passed, text, ex, fm = verdict(llama_engine, (CHEATERS / f"{name}.py").read_text())
    assert not passed, f"{name} was not caught"
    assert EXPECT[name] in text, text
    # the engine is intact afterwards: the reference copy is still exact and valid
    ok, text, ex, fm = verdict(llama_engine, reference_source(llama_engine))
    assert ok, text


def test_process_guard_puts_back_what_a_pass_changed_for_good():
    """Replaced and added names in the namespaces the reference runs on (builtins: replaced
    only), and torch settings left changed, are reported and put back; a submodule imported
    since (torch._dynamo and the like) and torch.manual_seed, which torch._dynamo rewraps on
    import, are not."""
    import builtins
    import types

    import torch
    import torch.nn.functional as F

    import engine_server.models.common as common
    from engine_server.guards import ProcessGuard
    guard = ProcessGuard()
    silu, seed, bf16 = F.silu, torch.manual_seed, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    threads, real_range = torch.get_num_threads(), builtins.range
    try:
        F.silu = lambda x: silu(x)
        common.len = lambda x: 0  # shadows the builtin for the model code
        builtins.range = lambda *a: real_range(*a)  # every caller's, the reference's too
        builtins.fresh_name = 1  # shadows nothing: a module's globals come first
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not bf16
        torch.set_num_threads(threads + 1)
        torch.fresh_submodule = types.ModuleType("torch.fresh_submodule")
        torch.manual_seed = lambda s: seed(s)
        guard.sweep()
        out = guard.check()
        assert F.silu is silu and not hasattr(common, "len") and builtins.range is real_range, out
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == bf16 and \
            torch.get_num_threads() == threads, out
        assert "tampered with the engine: torch.nn.functional.silu was replaced" in out, out
        assert "tampered with the engine: engine_server.models.common.len was added" in out, out
        assert "tampered with the engine: builtins.range was replaced" in out, out
        assert any("allow_bf16_reduced_precision_reduction" in v for v in out), out
        assert any("torch.get_num_threads" in v for v in out), out
        assert not any("fresh_submodule" in v or "manual_seed" in v or "fresh_name" in v for v in out), out
        assert len(out) == 5 and guard.check() == [], out  # each reported once, and nothing left
    finally:
        F.silu, torch.manual_seed, builtins.range = silu, seed, real_range
        vars(builtins).pop("fresh_name", None)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16
        torch.set_num_threads(threads)
        vars(common).pop("len", None)
        vars(torch).pop("fresh_submodule", None)


def test_guards_are_swept_between_rounds_replays_and_sides(llama_engine):
    """A pass that puts things back before a call ends is still seen: the process guard is
    swept after each of the fast tier's candidate turns, after each full-tier replay and after
    the candidate's side of the exactness check."""
    eng = llama_engine
    r = eng.submit_forward_pass(reference_source(eng))
    swept, sweep = [], eng.sweep_guards
    eng.sweep_guards = lambda: (swept.append(1), sweep())
    try:
        fm = eng.measure_fast(r.candidate_id)
        rounds = fm.config["stopped"]["rounds"] + eng.config.warmup_rounds
        assert fm.valid and len(swept) >= rounds, (len(swept), rounds)
        swept.clear()
        full = eng.measure_full(r.candidate_id)
        assert full.valid and len(swept) == 1 + 2 * eng.config.full_reps, len(swept)
        swept.clear()
        ex = eng.check_bit_exact(r.candidate_id)
        assert ex.exact and len(swept) >= 1, len(swept)
    finally:
        eng.sweep_guards = sweep
