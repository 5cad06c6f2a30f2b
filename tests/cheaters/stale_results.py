"""Cheater: keeps results across calls, keyed by the batch's inputs (a 'memo' that is fast
whenever a benchmark repeats its inputs)."""
from engine_server.models import llama as ref

_memo = {}


def forward(state, batch):
    key = (batch.tokens.cpu().numpy().tobytes(), batch.positions.cpu().numpy().tobytes(),
           batch.slots.cpu().numpy().tobytes(), state.layers)
    if key not in _memo:
        _memo[key] = ref.forward(state, batch).clone()
    return _memo[key]
