"""Cheater: returns before its work is done. On CUDA the logits are copied into the output
on a side stream the caller's stream never waits for (after a delay, so the caller reads a
stale output); on the CPU a thread fills them in a moment later."""
import threading
import time

import torch

from engine_server.models import llama as ref


def forward(state, batch):
    out = torch.zeros(batch.size, state.config.vocab_size, dtype=state.dtype, device=state.device)
    logits = ref.forward(state, batch)
    if out.is_cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time the caller's stream does not see
            out.copy_(logits)
        return out

    def late():
        time.sleep(0.01)
        out.copy_(logits)
    threading.Thread(target=late, daemon=True).start()
    return out
