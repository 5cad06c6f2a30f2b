"""Cheater: pads the no-layer forward pass as depth_padder.py does, except shortly after a
full-depth call, when a depth check may be timing it: a harness that times full depth just
before the no-layer steps it checks sees an honest pass there, while every other round's
extrapolation is padded. Outputs stay exact."""
import dataclasses

from engine_server.models import llama as ref

WINDOW = 8  # calls: a timing of full depth and one of the fast layers, a few steps each
_recent: list[bool] = []  # whether each of the last WINDOW calls ran every layer


def forward(state, batch):
    if not state.layers and not any(_recent):
        ref.forward(dataclasses.replace(state, layers=(0,)), batch)
    _recent.append(len(state.layers) == state.config.num_layers)
    del _recent[:-WINDOW]
    return ref.forward(state, batch)
