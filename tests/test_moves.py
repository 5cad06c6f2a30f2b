"""The search agent's moves: every move renders a module that parses and defines forward; on
in-process engines (shrunk Llama and Qwen2, float32 on the CPU) the engine says which stay
bitwise exact, and every move that claims exactness must be. The table of outcomes is printed
(pytest -s) so a change of the reference that breaks a move shows which one."""
from __future__ import annotations

import ast

import pytest

from engine_server.engine import Engine, EngineConfig
from tkcc_mcp.agents import moves as M

FAMILIES = ("llama", "moe", "gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_move_renders_a_module_that_defines_forward(family):
    src = M.load_sources(family)
    ok = M.applicable(family, src)
    assert set(ok) == set(M.available(M.Spec(family))), "a move no longer matches the reference source"
    for moves in [[m] for m in ok] + [ok]:
        spec = M.apply(M.Spec(family), moves)
        text = M.render(spec, src)
        tree = ast.parse(text)
        defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert "forward" in defs, spec.name
        compile(text, spec.name, "exec")
        assert all(m in text for m in spec.moves)  # the header names what was done
        assert M.parse_name(spec.name) == (family, frozenset(spec.moves))


def test_moves_compose_and_fail_loudly_on_a_changed_reference():
    src = M.load_sources("llama")
    a = M.apply(M.Spec("llama"), ["slot_view", "inference_mode"])
    assert a == M.apply(M.Spec("llama"), ["inference_mode", "slot_view"])  # order does not matter
    assert M.remove(a, "slot_view").moves == {"inference_mode"}
    assert "kv_prefix" not in M.available(M.Spec("llama"), "cuda")  # host syncs would disable graphs
    assert M.parse_name("not ours") is None and M.parse_name("llama:reference") == ("llama", frozenset())
    changed = dict(src)
    common = src["engine_server/models/common.py"]
    changed["engine_server/models/common.py"] = common.replace("batch.slots)", "batch.slots.tolist())")
    with pytest.raises(M.NotApplicable, match="gathers the slots 0 times"):
        M.render(M.Spec("llama", frozenset({"slot_view"})), changed)
    assert "slot_view" not in M.applicable("llama", changed)
    numbered = "\n".join(f"{i:5d}  {ln}" for i, ln in enumerate(["a = 1", "", "  b"], 1))
    assert M.strip_numbers(numbered) == "a = 1\n\n  b"


def exactness_table(eng: Engine) -> dict[str, bool]:
    family = eng.model.family
    src = M.load_sources(family)
    ok = M.applicable(family, src)
    claimed = [m for m in ok if M.MOVES[m].exact]
    plans = {m: [m] for m in ok} | {"all claimed exact": claimed, "all": ok}
    table = {}
    for label, moves in plans.items():
        spec = M.apply(M.Spec(family), moves)
        r = eng.submit_forward_pass(M.render(spec, src), name=spec.name)
        assert r.ok, (label, r.error)
        ex = eng.check_bit_exact(r.candidate_id)
        assert ex.ok, (label, ex.error)
        table[label] = ex.exact
        eng.remove(r.candidate_id)
    print(f"\n{eng.model.name}: " + ", ".join(f"{k}={'exact' if v else 'NOT exact'}" for k, v in table.items()))
    return table


def check_claims(table: dict[str, bool]) -> None:
    for m, exact in table.items():
        if m in M.MOVES and M.MOVES[m].exact:
            assert exact, f"{m} claims bitwise exactness but the engine says it is not"
    assert table["all claimed exact"], "the composition of the exact moves is not exact"


def test_exactness_on_llama(llama_engine):
    table = exactness_table(llama_engine)
    check_claims(table)
    # the unclaimed move, recorded: a prefix rounded up to 32 keys keeps the CPU kernels' order
    assert table["kv_prefix"] and table["all"]


@pytest.fixture(scope="module")
def qwen_engine():
    return Engine(EngineConfig(model="qwen2.5-0.5b", shrink=True, device="cpu", call_timeout_s=30))


def test_exactness_on_qwen2(qwen_engine):
    table = exactness_table(qwen_engine)  # q/k/v biases: the fused projection's bias path
    check_claims(table)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt2"])
def test_other_families_get_fewer_moves_and_stay_exact(model):
    eng = Engine(EngineConfig(model=model, shrink=True, device="cpu", exact_steps=3, exact_rows=2))
    family = eng.model.family
    claimed = [m for m in M.applicable(family, M.load_sources(family)) if M.MOVES[m].exact]
    assert "inference_mode" in claimed and len(claimed) < len(M.MOVES)
    spec = M.apply(M.Spec(family), claimed)
    r = eng.submit_forward_pass(M.render(spec, M.load_sources(family)))
    assert r.ok, r.error
    assert eng.check_bit_exact(r.candidate_id).exact
