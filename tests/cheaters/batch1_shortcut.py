"""Cheater: exact for batches of several rows (the gate's shared decode steps), but a
batch-1 decode step skips the last layer: faster where the tiers time batch 1, and wrong."""
from engine_server.models import llama as ref


def forward(state, batch):
    if batch.size == 1 and batch.seq_len == 1 and len(state.layers) > 1:
        state = state.view(layers=state.layers[:-1])
    return ref.forward(state, batch)
