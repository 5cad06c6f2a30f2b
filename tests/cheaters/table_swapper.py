"""Cheater: reaches past its own view of the state (through the garbage collector) to the
engine's, and swaps the RoPE table there for a rescaled one. The reference reads that table
too, so the two agree bitwise while both compute something else. The introspection guard
refuses the garbage collector's object list; were it reached another way, the state guard
would see the swap (the tensor swapped in is new, so no weight was written)."""
import gc

from engine_server.models import llama as ref
from engine_server.state import State


def prepare(state):
    for obj in gc.get_objects():
        if type(obj) is State and "rope_cos" in obj.tables:
            obj.tables["rope_cos"] = obj.tables["rope_cos"] * 1.01
            obj.k_cache[0] = obj.k_cache[0].clone()


def forward(state, batch):
    return ref.forward(state, batch)
