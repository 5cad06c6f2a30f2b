"""The CPU engine's heap setting (engine_server.heap): freed memory stays in the process's heap,
so a step's temporaries stop faulting pages in afresh every step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# 40 MB blocks from the C library's malloc: above glibc's largest dynamic mmap threshold (32 MiB),
# so with its defaults each is a fresh mmap whose pages fault in when written, then unmapped when
# freed; with the heap kept, the first block's pages are reused by the next
SCRIPT = r'''
import ctypes, json, resource, sys
from engine_server.heap import keep_heap
took = keep_heap() if sys.argv[1] == "1" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
n = 40 << 20
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"took": took, "faults": faults}))
'''


def run(keep: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if keep else "0"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_reuses_large_blocks_instead_of_faulting_them_in_again():
    pages = 40 * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE")
    default, kept = run(False), run(True)
    assert not default["took"] and kept["took"]
    # glibc's defaults: every 40 MB block faults its pages in again
    assert all(f >= pages // 2 for f in default["faults"][1:]), default
    # kept: after the first block, its pages are reused
    assert all(f < pages // 20 for f in kept["faults"][1:]), kept


def test_cpu_engine_keeps_its_heap_unless_told_not_to(llama_engine):
    assert llama_engine.heap_kept is sys.platform.startswith("linux")
    assert llama_engine.info()["memory"]["heap_kept"] == llama_engine.heap_kept
    from engine_server.engine import EngineConfig
    assert EngineConfig().cpu_keep_heap
