"""Cheater: slows the reference down. The reference looks `F.linear` up as it runs; this
pass puts the original back as each of its own calls starts and leaves a slowed copy in its
place when it returns, so the reference's calls in between run slower and its own do not."""
import time

import torch.nn.functional as F

from engine_server.models import llama as ref

_linear = F.linear


def _slowed(*args, **kwargs):
    until = time.perf_counter() + 5e-5
    while time.perf_counter() < until:
        pass
    return _linear(*args, **kwargs)


def forward(state, batch):
    F.linear = _linear
    try:
        return ref.forward(state, batch)
    finally:
        F.linear = _slowed
