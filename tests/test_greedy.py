"""engine_server.greedy.argmax is torch.argmax to the bit: ties, NaN, a short last slice."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_server import greedy


def _rows(V: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g).to(dtype)
    x[1, V - 1] = 100.0  # the max in the last entry (the short slice, when there is one)
    x[2, V // 3] = x[2, (V // 3 + greedy.CHUNK) % V] = x[2, V - 2] = 100.0  # a three-way tie: the first wins
    x[3, (7 * greedy.CHUNK + 5) % V] = float("nan")
    x[3, (9 * greedy.CHUNK) % V] = float("nan")  # NaN is maximal: the first NaN wins
    x[4] = -float("inf")  # all -inf: index 0
    return x


@pytest.mark.parametrize("V", [128256, 50257, 4096, 300, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_pass_argmax_is_torch_argmax(V, dtype):
    x = _rows(max(V, 16), dtype)
    want = torch.argmax(x, -1, keepdim=True)
    got = greedy.argmax(x, impl="two_pass")
    assert got.dtype == torch.int64 and got.shape == (5, 1)
    assert torch.equal(got, want), (got.view(-1), want.view(-1))
    out = torch.full((5, 1), -1, dtype=torch.int64)
    assert greedy.argmax(x, out=out, impl="two_pass") is out and torch.equal(out, want)
    assert torch.equal(greedy.argmax(x), want)  # the CPU default: torch.argmax itself


TRITON_SCRIPT = r"""
import json, torch
from engine_server import greedy
from tests.test_greedy import _rows
res = []
for V in (128256, 5000, 1100, 300):
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(V, dtype)
        out = torch.full((5, 1), -1, dtype=torch.int64)
        pos = torch.tensor([[7], [0], [3], [9], [1]], dtype=torch.int64)
        got = greedy.argmax(x, out=out, impl="triton", advance=pos)
        res.append([V, str(dtype), got is out, torch.equal(out, torch.argmax(x, -1, keepdim=True)),
                    pos.view(-1).tolist() == [8, 1, 4, 10, 2]])
print("RESULTS " + json.dumps(res))
"""


@pytest.mark.skipif(not greedy.HAVE_TRITON, reason="triton is not installed")
def test_triton_argmax_is_torch_argmax_under_the_interpreter():
    """The Triton kernels (run by the interpreter on the CPU) give torch.argmax's indices, and
    the second adds 1 to every row's entry of `advance`."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1][8:])
    assert len(res) == 8 and all(r[2] and r[3] and r[4] for r in res), res


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="unknown argmax impl"):
        greedy.argmax(torch.zeros(1, 4096), impl="cub")


@pytest.mark.parametrize("impl", ["torch", "two_pass"])
def test_advance_adds_one_a_row_after_the_choice(impl):
    x = _rows(4096, torch.float32)
    pos = torch.arange(5, dtype=torch.int64) * 10  # [B]
    got = greedy.argmax(x, impl=impl, advance=pos)
    assert torch.equal(got, torch.argmax(x, -1, keepdim=True))
    assert pos.tolist() == [1, 11, 21, 31, 41]


@pytest.mark.parametrize("bad", [torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int64),
                                 torch.zeros(5, 1, 1, dtype=torch.int64)])
def test_advance_of_the_wrong_shape_or_dtype_is_refused_untouched(bad):
    before = bad.clone()
    with pytest.raises(ValueError, match="advance: int64 with one entry a row"):
        greedy.argmax(torch.zeros(5, 4096), advance=bad)
    assert torch.equal(bad, before)


def test_advance_on_another_device_is_refused():
    with pytest.raises(ValueError, match="on the logits' device"):
        greedy.argmax(torch.zeros(5, 4096), advance=torch.zeros(5, dtype=torch.int64, device="meta"))


def test_pdl_only_where_the_device_has_it():
    assert not greedy.pdl_capable(torch.device("cpu"))
    with pytest.raises(ValueError, match="no programmatic dependent launch"):
        greedy.argmax(torch.zeros(1, 4096), impl="triton", pdl=True)
