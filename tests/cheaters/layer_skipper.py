"""Cheater: runs every layer when all are asked for (so the full-model exactness check
passes), but none of them when it sees the fast tier's subset."""
from engine_server.models import llama as ref


def forward(state, batch):
    if len(state.layers) < state.config.num_layers:
        state = state.view(layers=())
    return ref.forward(state, batch)
