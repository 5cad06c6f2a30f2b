import os
from pathlib import Path

import pytest

os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CHEATERS = Path(__file__).parent / "cheaters"


def example_source(name: str, override: dict | None = None) -> str:
    """examples/candidates/<name>.py with `override` merged into its KNOBS literal, as the
    variants stage does (forward_bench.override_knobs), whatever the file's current values and
    layout. A knob the file cannot read (a renamed or misspelt one) is a ValueError, not a copy
    that nothing reads."""
    from benchmarks.forward_bench import override_knobs
    path = ROOT / "examples" / "candidates" / f"{name}.py"
    src = path.read_text()
    return override_knobs(src, override, path.name) if override else src


@pytest.fixture(scope="session")
def llama_engine():
    """One shrunk Llama engine shared by the tests that only install and measure."""
    from engine_server.engine import Engine, EngineConfig
    return Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu", call_timeout_s=20))
