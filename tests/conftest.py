import os
from pathlib import Path

import pytest

os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CHEATERS = Path(__file__).parent / "cheaters"
# knobs a group may take without the file's KNOBS spelling them out (each documented as optional)
OPTIONAL_KNOBS = {"maxnreg", "DOT_BLOCK_N", "LOOP_STAGES"}


def example_source(name: str, override: dict | None = None) -> str:
    """examples/candidates/<name>.py with `override` merged into its KNOBS literal, as the
    variants stage does (forward_bench's find_knobs, merged, rewrite_knobs), whatever the file's
    current values and layout. Every overridden knob must already be in the file's KNOBS (or
    be one of OPTIONAL_KNOBS): a renamed knob fails here instead of becoming one nothing reads."""
    from benchmarks.forward_bench import find_knobs, merged, rewrite_knobs
    path = ROOT / "examples" / "candidates" / f"{name}.py"
    src = path.read_text()
    if not override:
        return src

    def known(knobs: dict, over: dict, where: str) -> None:
        for k, v in over.items():
            if k not in knobs and k not in OPTIONAL_KNOBS:
                raise KeyError(f"{path.name} has no KNOBS{where}[{k!r}]")
            if isinstance(v, dict):
                known(knobs[k], v, f"{where}[{k!r}]")
    knobs, span = find_knobs(src)
    known(knobs, override, "")
    return rewrite_knobs(src, span, merged(knobs, override))


@pytest.fixture(scope="session")
def llama_engine():
    """One shrunk Llama engine shared by the tests that only install and measure."""
    from engine_server.engine import Engine, EngineConfig
    return Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu", call_timeout_s=20))
