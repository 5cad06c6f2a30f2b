"""Cheater: returns before its work is done. On CUDA the logits are computed on a side
stream the caller's stream never waits for; on the CPU a thread fills them in a moment later."""
import threading
import time

import torch

from engine_server.models import llama as ref


def forward(state, batch):
    out = torch.zeros(batch.size, state.config.vocab_size, dtype=state.dtype, device=state.device)
    if out.is_cuda:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
            out.copy_(ref.forward(state, batch))
        return out
    logits = ref.forward(state, batch)

    def late():
        time.sleep(0.01)
        out.copy_(logits)
    threading.Thread(target=late, daemon=True).start()
    return out
