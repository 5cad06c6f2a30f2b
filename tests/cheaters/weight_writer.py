"""Cheater: writes to the weights (doubles then halves a norm weight in place: the values are
unchanged, so only a guard on the weights themselves can see it)."""
from engine_server.models import llama as ref


def forward(state, batch):
    w = state.weights["model.norm.weight"]
    w.mul_(2.0).div_(2.0)
    return ref.forward(state, batch)
