"""Registers, spills and residency of a candidate's decode-step kernels, compiled for sm_90 on
any machine (no GPU: Triton's own ptxas and cuobjdump).

    python benchmarks/kernel_resources.py [--shrink] [--set '{"gate_up": {"PIPE": true}}'] FILE

Records one batch-1 decode step's Triton launches on the CPU (intercepted, not run; the
model's first layer and lm_head, random weights; programmatic dependent launch on, as on an
H200), compiles each distinct launch for sm_90 with the specialisation the JIT would give it
(16-byte-divisible pointers and integers marked so), and prints for each: its grid and
programs, warps, registers a thread, stack bytes (spills), shared memory a program (the
cubin's static and the launch's dynamic), how many of its programs one multiprocessor holds
(by registers: 65,536, allocated per warp in 256s; by warps: 64; by shared memory: 228 KB,
1 KB of it reserved a program) and the share of the GPU's register file (--sms
multiprocessors) its whole grid needs: above 1 the grid cannot all be resident at once, and
whatever share a kernel holds is what the kernel launched early beside it (PDL) cannot. `--set` overrides KNOBS as the
variants runs do (`forward_bench.override_knobs`: nested dicts merged key by key). The
Triton here may allocate registers otherwise than the GPU image's (`profile_step.py
--resources` reads them there). Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from benchmarks.common import emit  # noqa: E402
from benchmarks.forward_bench import override_knobs  # noqa: E402
from engine_server.candidate import load_module  # noqa: E402
from engine_server.config import resolve_model, shrink  # noqa: E402
from engine_server.models import llama as ref  # noqa: E402
from engine_server.state import State, decode_batch, new_cache  # noqa: E402
from engine_server.weights import init_weights  # noqa: E402

REGS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
# sm_90: shared memory a multiprocessor has for its programs, and what the system reserves a program
SMEM_PER_SM, SMEM_RESERVED = 233472, 1024
TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
         torch.int32: "*i32"}


def record(module, cfg) -> list[tuple]:
    """The (kernel, grid, args, kwargs) of one batch-1 decode step of `module`, not run."""
    from triton.runtime.jit import JITFunction
    launches: list[tuple] = []
    weights = init_weights(cfg, 0, torch.bfloat16, "cpu")
    tables = ref.tables(cfg, weights, 1024, torch.bfloat16, "cpu")
    k, v = new_cache(cfg, 1, 1024, torch.bfloat16, "cpu")
    state = State(cfg, weights, k, v, tables, tuple(range(cfg.num_layers)))
    if hasattr(module, "prepare"):  # as the engine does at install
        module.prepare(state)
    module._supported = lambda state, batch: True
    module._pdl_capable = lambda dev: True
    orig = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: (lambda *a, **kw: launches.append((self, grid, a, kw)))
    try:
        module.forward(state, decode_batch(torch.tensor([7]), torch.tensor([500]), torch.tensor([0])))
    finally:
        JITFunction.__getitem__ = orig
    return launches


def warp_registers(regs: int) -> int:
    """Registers a warp holds at `regs` a thread (allocated in 256s)."""
    return -(-regs * 32 // 256) * 256


def residency(regs: int, warps: int, shared: int = 0) -> tuple[int, int, int, int]:
    """Programs of a kernel (`regs` registers a thread, `warps` warps, `shared` bytes of shared
    memory a program) one multiprocessor holds: (by registers, by warps, by shared memory, and
    what all three and the 32-block limit allow)."""
    by_regs, by_warps = REGS_PER_SM // (warp_registers(regs) * warps), WARPS_PER_SM // warps
    by_shared = SMEM_PER_SM // (shared + SMEM_RESERVED)
    return by_regs, by_warps, by_shared, min(by_regs, by_warps, by_shared, BLOCKS_PER_SM)


def specialise(fn, args, kw) -> tuple[dict, dict, dict]:
    """One launch's (signature, constexprs, attributes) as the JIT would specialise it: pointers
    and integers divisible by 16 marked so."""
    sig, consts, attrs = {}, {}, {}
    values = list(args) + [kw.get(p.name) for p in fn.params[len(args):]]
    for i, (p, a) in enumerate(zip(fn.params, values)):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", a
            continue
        if isinstance(a, torch.Tensor):
            sig[p.name] = TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif isinstance(a, float):
            sig[p.name], aligned = "fp32", False
        elif not isinstance(a, int):  # a tensor descriptor (Gluon's TMA): the JIT's own type string
            from triton.runtime.jit import mangle_type
            sig[p.name], aligned = mangle_type(a), False
        else:
            sig[p.name] = "i64" if abs(int(a)) >= 2 ** 31 else "i32"
            aligned = int(a) % 16 == 0 and int(a) != 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_sm90(fn, args, kw):
    """Compile one launch for sm_90 as the JIT would; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    sig, consts, attrs = specialise(fn, args, kw)
    opts = {o: kw[o] for o in ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg") if o in kw}
    source = triton.compiler.ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # a Gluon kernel (triton.experimental.gluon)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def usage(cubin: bytes) -> dict:
    """Registers, stack and shared memory of the one kernel in `cubin` (cuobjdump)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise SystemExit(f"no cuobjdump at {tool}: this Triton does not carry the NVIDIA tools")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(fields["SHARED"])}


def name_of(fn, args, cfg) -> str:
    """A GEMV launch's projection (by its weight's shape), else the kernel's name."""
    if fn.__name__ != "_gemv_kernel":
        return fn.__name__
    D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, D): "qkv", (D, cfg.num_heads * hd): "o",
              (2 * I, D): "gate_up", (D, I): "down"}
    return shapes.get(tuple(args[1].shape), "lm_head")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("candidate")
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--set", default="{}", help="JSON: KNOBS overrides, nested dicts merged key by key")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors (an H200 has 132)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    source = Path(a.candidate).read_text()
    if json.loads(a.set):  # as a variants run writes its copies
        source = override_knobs(source, json.loads(a.set), a.candidate)
    module = load_module("resources", source)
    cfg = resolve_model(a.model)[0]
    cfg = dataclasses.replace(shrink(cfg) if a.shrink else cfg, num_layers=1)
    rows, seen = [], set()
    for fn, grid, args, kw in record(module, cfg):
        name = name_of(fn, args, cfg)
        c = compile_sm90(fn, args, kw)
        u = usage(c.asm["cubin"])
        u["shared"] += c.metadata.shared  # the launch's dynamic shared memory (Triton's pipelines,
        # layout conversions), beside the static the cubin declares
        key = (name, c.hash)
        if key in seen:
            continue
        seen.add(key)
        warps = int(kw.get("num_warps", 4))
        programs = 1
        for g in grid:
            programs *= int(g)
        by_regs, by_warps, by_shared, per_sm = residency(u["regs"], warps, u["shared"])
        share = programs * warp_registers(u["regs"]) * warps / (a.sms * REGS_PER_SM)
        rows.append({"kernel": name, "grid": list(grid), "programs": programs, "warps": warps, **u,
                     "per_sm_by_registers": by_regs, "per_sm_by_warps": by_warps,
                     "per_sm_by_shared": by_shared, "per_sm": per_sm,
                     "register_file_share": round(share, 3)})
    import triton
    print(f"== sm_90 resources of {Path(a.candidate).name} ({a.model}{' shrunk' if a.shrink else ''}, batch-1 decode, "
          f"Triton {triton.__version__}, {a.sms} SMs)")
    print(f"  {'kernel':<22} {'programs':>8} {'warps':>5} {'regs':>4} {'stack':>5} {'shared':>6} {'per SM':>6}  "
          f"register file")
    for r in rows:
        print(f"  {r['kernel']:<22} {r['programs']:8d} {r['warps']:5d} {r['regs']:4d} {r['stack']:5d} {r['shared']:6d} "
              f"{r['per_sm']:6d}  {r['register_file_share']:.2f}")
    res = {"bench": "kernel_resources", "candidate": a.candidate, "model": a.model, "shrink": a.shrink,
           "overrides": json.loads(a.set), "sms": a.sms, "triton": triton.__version__, "kernels": rows}
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
