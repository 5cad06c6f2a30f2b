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
