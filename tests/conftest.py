import os
from pathlib import Path

import pytest

os.environ.setdefault("TKCC_LOG_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CHEATERS = Path(__file__).parent / "cheaters"


@pytest.fixture(scope="session")
def llama_engine():
    """One shrunk Llama engine shared by the tests that only install and measure."""
    from engine_server.engine import Engine, EngineConfig
    return Engine(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu", call_timeout_s=20))
