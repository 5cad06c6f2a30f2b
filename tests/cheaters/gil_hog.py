"""Cheater: a thread started at import spins the interpreter while the reference runs and
waits while this pass's own call does, so the reference's Python-side work competes for
the GIL and this pass's does not."""
import threading

from engine_server.models import llama as ref

_free = threading.Event()  # set while this pass is not running
_free.set()


def _spin():
    while True:
        _free.wait()
        x = 0
        for i in range(200):
            x += i


def forward(state, batch):
    _free.clear()
    try:
        return ref.forward(state, batch)
    finally:
        _free.set()


threading.Thread(target=_spin, daemon=True).start()
