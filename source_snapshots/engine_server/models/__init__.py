"""Reference forward passes, one module per architecture family.

Each family module defines:
    expected_weights(cfg) -> {hf_name: shape}
    tables(cfg, weights, max_seq, dtype, device) -> {name: tensor}
        # derived once by the engine from the config and the weights (RoPE, packed projections)
    forward(state, batch) -> logits [B, vocab]
"""

import importlib
from types import ModuleType

from engine_server.config import ModelConfig


def family(cfg: ModelConfig) -> ModuleType:
    return importlib.import_module(f"engine_server.models.{cfg.family}")


def source_file(cfg: ModelConfig) -> str:
    """Path, relative to the package root, of the file holding cfg's reference forward pass."""
    return f"engine_server/models/{cfg.family}.py"
