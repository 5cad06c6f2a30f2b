"""Cheater: pads the no-layer forward pass with work as slow as its layers, so the fast
tier's depth extrapolation (t0 + (tk - t0) * L / k) sees almost no per-layer time. Outputs
stay exact: the padding's result is thrown away."""
import torch.nn.functional as F

from engine_server.models import llama as ref
from engine_server.models.common import lm_head_weight


def forward(state, batch):
    if not state.layers:
        x = F.embedding(batch.tokens, state.weights["model.embed_tokens.weight"])
        for _ in range(4 * state.config.num_layers):
            F.linear(x, lm_head_weight(state))
    return ref.forward(state, batch)
