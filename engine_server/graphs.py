"""Shape-keyed CUDA graphs for decode steps.

One `StepGraphs` per installed forward pass: a dict from (layers, batch size) to a graph
captured over the engine's static input buffers, all in one memory pool. Warm-up runs
before capture on a side stream (as PyTorch requires); shapes never captured run eagerly.
On the CPU nothing is captured and `run` is the eager call. The reference model never
knows about graphs: they wrap whatever `forward` was installed.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine_server.state import Batch, State


class StaticInputs:
    """Engine-owned decode input buffers, one set per batch size, shared by every graph."""

    def __init__(self, sizes: list[int], device):
        self.batches = {
            b: Batch(torch.zeros(b, 1, dtype=torch.long, device=device),
                     torch.zeros(b, 1, dtype=torch.long, device=device),
                     torch.zeros(b, dtype=torch.long, device=device))
            for b in sizes}

    def fill(self, batch: Batch) -> Batch:
        """Copy `batch` (decode, T=1) into the static buffers of its size and return them."""
        static = self.batches[batch.size]
        static.tokens.copy_(batch.tokens)
        static.positions.copy_(batch.positions)
        static.slots.copy_(batch.slots)
        return static


def capture(fn: Callable[[], object], pool=None, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` `warmup` times on a side stream (as PyTorch requires before a capture), then
    capture one call of it into a CUDA graph in `pool`. Returns the graph and that call's
    output (the graph's static output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


class StepGraphs:
    def __init__(self, forward: Callable, inputs: StaticInputs, pool=None, warmup: int = 2):
        self.forward = forward
        self.inputs = inputs
        self.pool = pool
        self.warmup = warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @staticmethod
    def key(state: State, batch_size: int) -> tuple:
        return (state.layers, batch_size)

    def capture(self, state: State, batch_size: int) -> None:
        """Capture forward(state, static batch of `batch_size`); the caller restores the cache."""
        static = self.inputs.batches[batch_size]
        self.graphs[self.key(state, batch_size)] = capture(lambda: self.forward(state, static), self.pool,
                                                           self.warmup)

    def run(self, state: State, batch: Batch) -> torch.Tensor:
        """Replay the graph for this shape if captured (inputs copied into the static
        buffers first), else run eagerly. Returns the logits (the graph's static output:
        read or clone before the next replay)."""
        entry = self.graphs.get(self.key(state, batch.size)) if batch.seq_len == 1 else None
        if entry is None:
            return self.forward(state, batch)
        self.inputs.fill(batch)
        entry[0].replay()
        return entry[1]

    def replay(self, state: State, batch_size: int) -> torch.Tensor:
        """Replay on whatever the static buffers hold (timing loops)."""
        g, out = self.graphs[self.key(state, batch_size)]
        g.replay()
        return out

    def has(self, state: State, batch_size: int) -> bool:
        return self.key(state, batch_size) in self.graphs

    def names(self) -> list[str]:
        return [f"layers={len(k[0])} B={k[1]}" for k in self.graphs]

    def clear(self) -> None:
        self.graphs.clear()
