"""Cheater: pads the no-layer forward pass with one decoder layer's work, thrown away, so the
fast tier's depth extrapolation (t0 + (tk - t0) * L / k) sees little or no per-layer time and
puts the pass near its fast-layer time whatever its depth. Outputs stay exact.

(Padding past the fast layers' time gains nothing: the extrapolation then takes the padded
no-layer time, which is about what the pass takes.)"""
import dataclasses

from engine_server.models import llama as ref


def forward(state, batch):
    if not state.layers:
        ref.forward(dataclasses.replace(state, layers=(0,)), batch)
    return ref.forward(state, batch)
