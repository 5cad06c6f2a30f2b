"""What a forward pass sees: `State` (weights, KV cache, config, layers) and `Batch`.

The candidate contract (the README says it too):

    forward(state, batch) -> logits   # [B, vocab], last position of each row
    prepare(state)                    # optional, once at install; may fill state.scratch

Rules a forward pass must keep, checked by `engine_server.guards` and `exact`:
- `state.weights` is read-only: never write to it.
- K/V go only into the cache cells the batch names: rows `batch.slots`, positions
  `batch.positions`, layers `state.layers`.
- Nothing is kept across calls except what `prepare` derived from the weights.
- All work is ordered on the current stream when `forward` returns.

KV cache layout, per layer l in [0, num_layers):
    k_cache[l]: [num_slots, num_kv_heads, max_seq, head_dim]   (v_cache the same)
A batch row b uses cache slot `slots[b]`; its query tokens sit at `positions[b, :]`
(contiguous, ascending); the keys a row may attend to are those at positions
0 .. positions[b, -1] of its own slot. Every row in a batch has the same T.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine_server.config import ModelConfig


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64, position of each token in its sequence
    slots: torch.Tensor  # [B] int64, KV cache slot of each row
    # Optional recorder for MoE routing: when a list, the reference appends each MoE layer's
    # chosen expert ids ([B*T, top_k] int64). None in timed and graphed runs.
    expert_log: list | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def to(self, device) -> "Batch":
        return Batch(self.tokens.to(device), self.positions.to(device), self.slots.to(device),
                     self.expert_log)

    def clone(self) -> "Batch":
        return Batch(self.tokens.clone(), self.positions.clone(), self.slots.clone(), None)


def decode_batch(tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> Batch:
    """One new token per row; `lengths` [B] = tokens already in each row's cache."""
    return Batch(tokens.view(-1, 1).long(), lengths.view(-1, 1).long(), slots.long())


def prefill_batch(tokens: torch.Tensor, slots: torch.Tensor, start: int = 0) -> Batch:
    """Rows of equal length T starting at position `start`."""
    B, T = tokens.shape
    pos = torch.arange(start, start + T, device=tokens.device).expand(B, T).contiguous()
    return Batch(tokens.long(), pos, slots.long())


@dataclass
class State:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF tensor names; read-only
    k_cache: list[torch.Tensor]  # per layer [num_slots, n_kv, max_seq, head_dim]
    v_cache: list[torch.Tensor]
    tables: dict[str, torch.Tensor]  # derived once by the engine (RoPE cos/sin, packed projections); read-only
    layers: tuple[int, ...]  # the layers to run, ascending; the fast tier runs a subset
    scratch: dict[str, Any] = field(default_factory=dict)  # a candidate's own, from prepare

    @property
    def device(self) -> torch.device:
        return self.k_cache[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache[0].dtype

    @property
    def num_slots(self) -> int:
        return self.k_cache[0].shape[0]

    @property
    def max_seq(self) -> int:
        return self.k_cache[0].shape[2]

    def view(self, layers: tuple[int, ...] | None = None, scratch: dict | None = None) -> "State":
        """Same tensors, another layer subset or scratch dict (no copies)."""
        return replace(self, layers=self.layers if layers is None else tuple(layers),
                       scratch=self.scratch if scratch is None else scratch)

    def clone_cache(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k.clone() for k in self.k_cache], [v.clone() for v in self.v_cache]

    def load_cache(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Copy cache contents in place (the tensors themselves never change identity)."""
        for dst, src in zip(self.k_cache, k):
            dst.copy_(src)
        for dst, src in zip(self.v_cache, v):
            dst.copy_(src)


def new_cache(cfg: ModelConfig, num_slots: int, max_seq: int, dtype, device):
    shape = (num_slots, cfg.num_kv_heads, max_seq, cfg.head_dim)
    k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    return k, v
