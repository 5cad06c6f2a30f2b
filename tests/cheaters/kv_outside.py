"""Cheater: 'prefetches' each new K/V one position ahead, outside the cells the batch owns.
The logits stay bitwise exact (later positions are masked), the cache does not."""
from engine_server.models import llama as ref


def forward(state, batch):
    out = ref.forward(state, batch)
    rows = batch.slots[:, None]
    ahead = (batch.positions + 1).clamp(max=state.max_seq - 1)
    for layer in state.layers:
        for cache in (state.k_cache[layer], state.v_cache[layer]):
            cache[rows, :, ahead] = cache[rows, :, batch.positions]
    return out
