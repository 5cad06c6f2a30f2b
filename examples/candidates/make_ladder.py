"""Write the ladder of intermediate candidates from llama_triton_decode.py.

Each step is the same module with fewer kernel groups switched on in KNOBS["stages"] (the
rest runs in PyTorch as the reference does) and a docstring header naming the step, so a
hill-climb can accept the Triton decode path one group at a time:

    llama_triton_attention.py   RoPE + K/V write + attention in Triton
    llama_triton_attn_norm.py   + embedding / residual add / RMSNorm fused
    llama_triton_decode.py      + GEMVs (qkv, o, gate_up with SiLU*up, down, lm_head): all

Run `python examples/candidates/make_ladder.py` after editing llama_triton_decode.py;
tests/test_examples.py checks the written files are current.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_triton_decode.py"
STAGES_ALL = '    "stages": {"attention": True, "norm": True, "gemv": True},\n'

LADDER = {
    "llama_triton_attention.py": (
        {"attention": True, "norm": False, "gemv": False},
        "Ladder step 1 of 3: only RoPE, the K/V write and attention run in Triton (decode);\n"
        "the embedding, norms, residual adds and projections are the reference's PyTorch ops.\n"
        "Gate: on CUDA the tolerance gate (`close`, identical tokens; the RoPE'd K/V differ from\n"
        "the reference's by rounding, so not bitwise); on the CPU (reference fallback) bitwise.\n"),
    "llama_triton_attn_norm.py": (
        {"attention": True, "norm": True, "gemv": False},
        "Ladder step 2 of 3: attention as in step 1, plus the embedding lookup, residual adds\n"
        "and RMSNorms fused into one Triton kernel per norm; the projections stay cuBLAS.\n"
        "Gate: on CUDA the tolerance gate (`close`, identical tokens); on the CPU bitwise.\n"),
}


def render(name: str, source: str | None = None) -> str:
    src = SOURCE.read_text() if source is None else source
    stages, header = LADDER[name]
    if STAGES_ALL not in src:
        raise ValueError("llama_triton_decode.py no longer has the all-on KNOBS['stages'] line")
    line = '    "stages": {' + ", ".join(f'"{k}": {v}' for k, v in stages.items()) + "},\n"
    assert src.startswith('"""')
    return '"""' + header + "\n" + src[3:].replace(STAGES_ALL, line, 1)


def main() -> None:
    for name in LADDER:
        (HERE / name).write_text(render(name))
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
