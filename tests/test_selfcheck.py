"""`selfcheck` on every shared config, shrunk for the CPU (what the issue asks to show)."""
import pytest

from engine_server.config import preset_names
from engine_server.engine import EngineConfig
from engine_server.selfcheck import run

SAME = 0.02


@pytest.mark.parametrize("preset", preset_names())
def test_selfcheck_every_preset(preset):
    lines = []
    rep = run(EngineConfig(model=preset, shrink=True, device="cpu"), out=lines.append)
    assert rep["exact_reference"] is True
    # an identical copy measures as fast as the reference: its 95% interval reaches within
    # SAME of 1.0. A bootstrap interval with sequential stopping on a shared 2-core host misses
    # the truth more often than one time in twenty, and two copies of the same code can differ
    # by a fraction of a percent in memory placement; a real bias of the tier (one side warmed,
    # timed twice, or at another depth) is several times larger and fails both tries.
    lo, hi = rep["speedup_fast_ci95_reference"]
    if not (lo <= 1.0 + SAME and hi >= 1.0 - SAME):
        again = run(EngineConfig(model=preset, shrink=True, device="cpu"), out=lines.append)
        lo, hi = again["speedup_fast_ci95_reference"]
    assert lo <= 1.0 + SAME and hi >= 1.0 - SAME, rep
    assert rep["exact_perturbed"] is False
    assert rep["first_mismatch_perturbed"]["phase"] == "prefill"
    if "moe" in preset or "mixtral" in preset or "a3b" in preset:
        assert rep["experts_active"] > 0
    else:
        assert "experts_active" not in rep
