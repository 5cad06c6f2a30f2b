"""Cheater: walks up from its forward pass to the fast tier's own frame and pads the list of
per-round speedups it is building, so the median says 7.5x. The outputs are the reference's,
so only a guard on reaching into the engine's frames can see it."""
import sys

from engine_server.models import llama as ref


def forward(state, batch):
    try:
        f = sys._getframe(1)
        while f is not None:
            if isinstance(f.f_locals.get("ratios"), list):
                f.f_locals["ratios"].extend([7.5] * 40)
            f = f.f_back
    except RuntimeError:
        pass  # refused: carry on as an honest pass would
    return ref.forward(state, batch)
