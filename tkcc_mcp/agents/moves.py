"""Source-level rewrites of the reference forward pass, composable: the offline search agent's
library of moves.

A candidate is the reference family's own module source (as `read_engine_source` returns it)
followed by overrides: functions the moves rewrote, defined again after the originals so
they replace them when the module is imported. What no move touches is the reference's own
code, so the candidate follows the reference exactly wherever it was not changed.

    sources = load_sources("llama")                # or read through the MCP tools
    spec = apply(Spec("llama"), ["slot_view", "inference_mode"])
    source = render(spec, sources)                 # text for submit_forward_pass

Moves (each is a transformation of a function's AST, or a small function that shadows one):
- forward:   `inference_mode` (wrap forward), `inplace_residual` (x = x + f(x) -> x.add_(f(x)),
             only when x starts as a fresh tensor)
- mlp:       `inplace_mlp` (F.silu(g) * u -> F.silu(g, inplace=True).mul_(u) on fresh temporaries)
- attention: a copy of `common.attention` is appended (the family module imports `attention`
             from common, so the copy shadows it) with `slot_view` (consecutive slots are viewed,
             not gathered with index_select), `kv_prefix` (decode steps keep keys 0..max position,
             rounded up to 32 so the kernels' vector blocks keep their order), `inplace_attention`
             (scale and mask the scores in place), `decode_write` (one-token steps write K/V with
             [B] indices).
A move whose pattern is not in the source raises `NotApplicable` (the reference changed);
`applicable(family, sources)` lists those that render. `MOVES[m].exact` is the claim that a
move keeps the outputs bitwise equal to the reference on the CPU in float32; None means the
engine decides (tests/test_moves.py records both). The MoE family is the Llama source with
moe.moe_mlp as its MLP; GPT-2 gets the forward and attention moves.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

SNAPSHOT = Path(__file__).resolve().parents[2] / "source_snapshots"
FILES = {"llama": "engine_server/models/llama.py", "moe": "engine_server/models/moe.py",
         "gpt2": "engine_server/models/gpt2.py", "common": "engine_server/models/common.py"}


class NotApplicable(ValueError):
    """The move's pattern is not in this reference source."""


@dataclass(frozen=True)
class Move:
    name: str
    doc: str
    families: tuple[str, ...]
    exact: bool | None  # bitwise equal to the reference on the CPU in float32 (None: the engine decides)
    syncs: bool = False  # reads batch values on the host: not capturable in a CUDA graph
    attention: bool = False  # needs the attention copy


MOVES: dict[str, Move] = {m.name: m for m in [
    Move("inference_mode", "run forward under torch.inference_mode(): no autograd bookkeeping per op",
         ("llama", "moe", "gpt2"), True),
    Move("inplace_residual", "add each block's output into the residual stream in place (x.add_)",
         ("llama", "moe", "gpt2"), True),
    Move("inplace_mlp", "SwiGLU on its own temporaries: silu in place, then multiply in place", ("llama",), True),
    Move("decode_write", "one-token steps write K/V with [B] slot and position indices instead of broadcast "
         "[B, T] ones", ("llama", "moe", "gpt2"), True, attention=True),
    Move("slot_view", "consecutive slots are viewed in the cache instead of gathered (copied) with "
         "index_select (one host read of the slots)", ("llama", "moe", "gpt2"), True, syncs=True, attention=True),
    Move("kv_prefix", "decode steps attend over keys 0..max position, rounded up to 32, instead of the whole "
         "slot (one host read of the positions)", ("llama", "moe", "gpt2"), None, syncs=True, attention=True),
    Move("inplace_attention", "scale and mask the attention scores in place (mul_, masked_fill_)",
         ("llama", "moe", "gpt2"), True, attention=True),
]}
ORDER = list(MOVES)


@dataclass(frozen=True)
class Spec:
    """A candidate: the family (the reference file's name) and the moves applied."""
    family: str  # llama | moe | gpt2
    moves: frozenset[str] = frozenset()

    @classmethod
    def of(cls, cfg, moves: Iterable[str] = ()) -> "Spec":
        """From an engine ModelConfig (anything with .family), or a family name."""
        return apply(cls(cfg if isinstance(cfg, str) else cfg.family), moves)

    @property
    def name(self) -> str:
        """Stable name: the family and its moves, sorted (the search uses it as the plan's key)."""
        return f"{self.family}:" + ("+".join(sorted(self.moves)) or "reference")

    def has(self, move: str) -> bool:
        return move in self.moves


def available(spec: Spec, device: str = "cpu") -> list[str]:
    """Moves for this family (no host-syncing moves on CUDA: they would disable CUDA graphs)."""
    return [m.name for m in MOVES.values() if spec.family in m.families
            and not (m.syncs and device.startswith("cuda"))]


def add(spec: Spec, move: str) -> Spec:
    """Unknown moves raise KeyError; moves for another family are skipped."""
    if spec.family not in MOVES[move].families:
        return spec
    return dataclasses.replace(spec, moves=spec.moves | {move})


def remove(spec: Spec, move: str) -> Spec:
    return dataclasses.replace(spec, moves=spec.moves - {move})


def apply(spec: Spec, moves: Iterable[str]) -> Spec:
    for m in moves:
        spec = add(spec, m)
    return spec


def parse_name(name: str) -> tuple[str, frozenset[str]] | None:
    """Inverse of Spec.name: (family, moves), or None when `name` is not one of ours."""
    m = re.fullmatch(r"(llama|moe|gpt2):([a-z_+]+)", (name or "").strip())
    if not m:
        return None
    moves = frozenset() if m.group(2) == "reference" else frozenset(m.group(2).split("+"))
    return (m.group(1), moves) if moves <= set(MOVES) else None


def neighbours(spec: Spec, device: str = "cpu", allowed: Iterable[str] | None = None
               ) -> list[tuple[str, Callable[[Spec], Spec]]]:
    """One-move changes of `spec`: add each absent move, remove each present one."""
    ok = set(available(spec, device)) & (set(allowed) if allowed is not None else set(MOVES))
    return [(f"-{m}", lambda s, m=m: remove(s, m)) if m in spec.moves else (f"+{m}", lambda s, m=m: add(s, m))
            for m in ORDER if m in ok]


# ---- sources ----------------------------------------------------------------------------------

def needed_files(family: str) -> list[str]:
    """Snapshot paths `render` needs for this family."""
    return [FILES[family], FILES["common"]] + ([FILES["llama"]] if family == "moe" else [])


def load_sources(family: str, root: Path = SNAPSHOT) -> dict[str, str]:
    """{snapshot path: text} from a snapshot directory (the agent reads them through MCP)."""
    return {p: (root / p).read_text() for p in needed_files(family)}


def strip_numbers(text: str) -> str:
    """read_engine_source's numbered lines ('   12  code') back to the file's text."""
    return "\n".join(m.group(1) if (m := re.match(r"^ *\d+  ?(.*)$", ln)) else ln for ln in text.splitlines())


# ---- rendering --------------------------------------------------------------------------------

def render(spec: Spec, sources: dict[str, str]) -> str:
    """Module source of the candidate `spec` describes. Raises NotApplicable when a move's
    pattern is not in the sources."""
    if spec.family not in ("llama", "moe", "gpt2"):
        raise NotApplicable(f"no moves for family {spec.family!r}")
    base_path = FILES["llama"] if spec.family == "moe" else FILES[spec.family]
    base = sources[base_path]
    tree = ast.parse(base)
    out = [base.rstrip("\n"), "", "",
           "# " + "-" * 90,
           f"# tkcc search candidate {spec.name}: the reference above, then the functions the moves rewrote.",
           *[f"#   {m}: {MOVES[m].doc}" for m in ORDER if m in spec.moves],
           "# " + "-" * 90, "", "import torch as _torch", ""]
    if spec.family == "moe":
        out += ["from engine_server.models.moe import moe_mlp as _moe_mlp  # the MoE family's MLP", ""]
    if any(MOVES[m].attention for m in spec.moves):
        out += _attention_overrides(spec, tree, sources[FILES["common"]])
    if spec.has("inplace_mlp"):
        out += [_unparse(_inplace_mlp(_function(tree, "mlp", base_path))), "", ""]
        if _has_default(_function(tree, "forward", base_path), "mlp") and not spec.has("inplace_residual"):
            # forward(state, batch, mlp=mlp) bound the original mlp when it was defined: define it again
            out += [_unparse(_function(tree, "forward", base_path)), "", ""]
    if spec.has("inplace_residual"):
        out += [_unparse(_inplace_residual(_function(tree, "forward", base_path))), "", ""]
    if spec.family == "moe":
        out += ["_llama_forward = forward", "", "",
                "def forward(state, batch):",
                '    """moe.forward: the Llama forward with the MoE MLP."""',
                "    return _llama_forward(state, batch, mlp=_moe_mlp)", ""]
    if spec.has("inference_mode"):
        out += ["_forward_impl = forward", "", "",
                "def forward(state, batch):",
                '    """The forward above, without autograd bookkeeping."""',
                "    with _torch.inference_mode():",
                "        return _forward_impl(state, batch)", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def applicable(family: str, sources: dict[str, str], device: str = "cpu") -> list[str]:
    """The moves that render on these sources, one at a time."""
    ok = []
    for m in available(Spec(family), device):
        try:
            render(Spec(family, frozenset({m})), sources)
            ok.append(m)
        except NotApplicable:
            continue
    return ok


def _function(tree: ast.Module, name: str, where: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise NotApplicable(f"{where} defines no top-level function {name}()")


def _unparse(fn: ast.FunctionDef) -> str:
    return ast.unparse(ast.fix_missing_locations(fn))


def _has_default(fn: ast.FunctionDef, name: str) -> bool:
    return any(isinstance(d, ast.Name) and d.id == name for d in fn.args.defaults + fn.args.kw_defaults if d)


def _copy(fn: ast.FunctionDef) -> ast.FunctionDef:
    return ast.parse(ast.unparse(fn)).body[0]


def _fresh_names(fn: ast.FunctionDef) -> set[str]:
    """Names the function binds to the result of a call or arithmetic (new tensors it owns)."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Call, ast.BinOp)):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.add(n.id)
    return out


def _inplace_residual(fn: ast.FunctionDef) -> ast.FunctionDef:
    """Inside the layer loop: `x = x + E` -> `x.add_(E)`, when x was first bound to a fresh tensor."""
    fn = _copy(fn)
    first: dict[str, ast.AST] = {}
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            first.setdefault(stmt.targets[0].id, stmt.value)
    changed = 0

    class T(ast.NodeTransformer):
        def visit_For(self, node):
            node.body = [self.rewrite(s) for s in node.body]
            return node

        def rewrite(self, s):
            nonlocal changed
            if (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
                    and isinstance(s.value, ast.BinOp) and isinstance(s.value.op, ast.Add)
                    and isinstance(s.value.left, ast.Name) and s.value.left.id == s.targets[0].id
                    and isinstance(first.get(s.targets[0].id), (ast.Call, ast.BinOp))):
                changed += 1
                x = s.targets[0].id
                return ast.Expr(ast.Call(ast.Attribute(ast.Name(x, ast.Load()), "add_", ast.Load()),
                                         [s.value.right], []))
            return s

    fn = T().visit(fn)
    if not changed:
        raise NotApplicable("forward has no residual `x = x + ...` in a layer loop over a fresh x")
    return fn


def _inplace_mlp(fn: ast.FunctionDef) -> ast.FunctionDef:
    """`F.silu(g) * u` -> `F.silu(g, inplace=True).mul_(u)` when g is a fresh temporary."""
    fn = _copy(fn)
    fresh = _fresh_names(fn)
    changed = 0

    class T(ast.NodeTransformer):
        def visit_BinOp(self, node):
            nonlocal changed
            self.generic_visit(node)
            left = node.left
            if (isinstance(node.op, ast.Mult) and isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute)
                    and left.func.attr == "silu" and len(left.args) == 1 and not left.keywords
                    and (isinstance(left.args[0], ast.Call)
                         or (isinstance(left.args[0], ast.Name) and left.args[0].id in fresh))):
                changed += 1
                silu = ast.Call(left.func, left.args, [ast.keyword("inplace", ast.Constant(True))])
                return ast.Call(ast.Attribute(silu, "mul_", ast.Load()), [node.right], [])
            return node

    fn = T().visit(fn)
    if not changed:
        raise NotApplicable("mlp has no `F.silu(gate) * up` on a fresh gate")
    return fn


# ---- the attention copy -----------------------------------------------------------------------

_HELPERS = {
    "slot_view": '''
def _slots(cache, slots):
    """cache[slots]: a view when the slots are consecutive (one host read), else a gather (a copy:
    the same bits however it is made)."""
    s = slots.tolist()
    if s == list(range(s[0], s[0] + len(s))):
        return cache[s[0]:s[0] + len(s)]
    return cache.index_select(0, slots)
''',
    "kv_prefix": '''
def _prefix(keys, vals, mask, batch):
    """Decode steps: keys 0..max position only, rounded up to 32 so the kernels' vector blocks
    keep their order; masked keys past a row's position contribute exact zeros either way."""
    if batch.positions.shape[1] != 1:
        return keys, vals, mask
    n = min(keys.shape[2], (int(batch.positions.max()) + 32) // 32 * 32)
    return keys[:, :, :n], vals[:, :, :n], mask[..., :n]
''',
    "decode_write": '''
def write_kv(state, layer, k, v, batch):
    """One-token steps index the cells with [B] vectors; longer steps use the reference's write."""
    if batch.positions.shape[1] != 1:
        return _reference_write_kv(state, layer, k, v, batch)
    pos = batch.positions[:, 0]  # [B]
    state.k_cache[layer][batch.slots, :, pos] = k[:, :, 0]  # cells [B, KV, D]
    state.v_cache[layer][batch.slots, :, pos] = v[:, :, 0]
''',
}


def _attention_overrides(spec: Spec, base_tree: ast.Module, common: str) -> list[str]:
    imported = {a.asname or a.name for n in base_tree.body if isinstance(n, ast.ImportFrom)
                and n.module == "engine_server.models.common" for a in n.names}
    if "attention" not in imported:
        raise NotApplicable("the reference does not import attention from engine_server.models.common")
    ctree = ast.parse(common)
    fn = _copy(_function(ctree, "attention", FILES["common"]))
    src = ast.unparse(fn)
    if spec.has("decode_write") and not re.search(r"\bwrite_kv\(state, layer, k, v, batch\)", src):
        raise NotApplicable("common.attention does not call write_kv(state, layer, k, v, batch)")
    if spec.has("slot_view"):
        fn = _replace_gathers(fn)
    if spec.has("kv_prefix"):
        fn = _insert_prefix(fn)
    if spec.has("inplace_attention"):
        fn = _inplace_scores(fn)
    defined = {n.name for n in ctree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in ctree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name.split(".")[0] for n in ctree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    loads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    free = sorted((loads - local) & defined)
    if spec.has("decode_write"):
        free = [n for n in free if n != "write_kv"]
    out = ["# common.attention, copied here with the attention moves (it shadows the imported one)"]
    if free:
        out.append(f"from engine_server.models.common import {', '.join(free)}")
    if spec.has("decode_write"):
        out.append("from engine_server.models.common import write_kv as _reference_write_kv")
    for m in ("decode_write", "slot_view", "kv_prefix"):
        if spec.has(m):
            out += [_HELPERS[m].rstrip(), ""]
    out += ["", _unparse(fn), "", ""]
    return out


def _replace_gathers(fn: ast.FunctionDef) -> ast.FunctionDef:
    changed = 0

    class T(ast.NodeTransformer):
        def visit_Call(self, node):
            nonlocal changed
            self.generic_visit(node)
            args = [ast.unparse(a) for a in node.args]
            cache = None
            if isinstance(node.func, ast.Attribute) and node.func.attr == "index_select" and args == ["0", "batch.slots"]:
                cache = node.func.value  # cache.index_select(0, batch.slots)
            elif len(args) == 2 and args[1] == "batch.slots" and "_cache[" in args[0]:
                cache = node.args[0]  # a helper such as gather_slots(cache, batch.slots): a copy, same bits
            if cache is None:
                return node
            changed += 1
            return ast.Call(ast.Name("_slots", ast.Load()), [cache, node.args[-1]], [])

    fn = T().visit(fn)
    if changed != 2:
        raise NotApplicable(f"attention gathers the slots {changed} times (index_select(0, batch.slots) or "
                            "a helper on the cache); expected keys and values")
    return fn


def _insert_prefix(fn: ast.FunctionDef) -> ast.FunctionDef:
    """Before the first statement that reads keys.shape: keys, vals, mask = _prefix(...)."""
    names = {t.id for s in fn.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
    if not {"keys", "vals"} <= names or "mask" not in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
        raise NotApplicable("attention has no keys/vals locals and mask parameter to cut to the prefix")
    for i, s in enumerate(fn.body):
        if "keys.shape" in ast.unparse(s):
            before = "\n".join(ast.unparse(x) for x in fn.body[:i])
            if "mask" not in before or "vals" not in before:
                break
            stmt = ast.parse("keys, vals, mask = _prefix(keys, vals, mask, batch)").body[0]
            fn.body.insert(i, stmt)
            return fn
    raise NotApplicable("attention reads keys.shape before keys, vals and mask are all set")


def _inplace_scores(fn: ast.FunctionDef) -> ast.FunctionDef:
    """`matmul(...) * s` -> `.mul_(s)`; `.masked_fill(` -> `.masked_fill_(` on the scores."""
    changed = 0

    class T(ast.NodeTransformer):
        def visit_BinOp(self, node):
            nonlocal changed
            self.generic_visit(node)
            if (isinstance(node.op, ast.Mult) and isinstance(node.left, ast.Call)
                    and ast.unparse(node.left.func) in ("torch.matmul", "torch.bmm")):
                changed += 1
                return ast.Call(ast.Attribute(node.left, "mul_", ast.Load()), [node.right], [])
            return node

        def visit_Call(self, node):
            nonlocal changed
            self.generic_visit(node)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "masked_fill" \
                    and ast.unparse(node.func.value).startswith("scores"):
                changed += 1
                node.func.attr = "masked_fill_"
            return node

    fn = T().visit(fn)
    if not changed:
        raise NotApplicable("attention scales and masks no `scores` it owns")
    return fn
