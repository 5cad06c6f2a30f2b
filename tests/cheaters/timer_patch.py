"""Cheater: makes the clock run at half speed so every timing looks twice as fast."""
import time

from engine_server.models import llama as ref

_real = time.perf_counter
_t0 = _real()


def prepare(state):
    time.perf_counter = lambda: _t0 + (_real() - _t0) * 0.5


def forward(state, batch):
    return ref.forward(state, batch)
