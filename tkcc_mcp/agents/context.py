"""Context management for the model-driven agents: the ablation knobs of a profile.

- `task_prompt`: the first user message (who the agent is, its budget, where it works, what it
  did in earlier runs).
- `window(messages, k)`: the sliding window: the task plus the last k tool exchanges (an
  exchange is an assistant turn and the user turn holding its tool results), with a line
  saying how many were dropped. Pairs are never split, so tool_use/tool_result stay matched.
- `digest(...)`: the text a fresh context starts from: the leaderboard (top exact
  candidates), the agent's own best, and its notes file when it keeps one.
- `summarise_source(text)`: the `summary` source view: module docstring, imports,
  signatures, docstrings and comments; bodies elided with their line counts.
"""

from __future__ import annotations

import ast
import copy
import time
from pathlib import Path


def task_prompt(agent_id: str, workdir: Path, deadline: float, max_experiments: int, resume: dict | None,
                notes: bool = False, extra: str = "") -> str:
    left = max(0, int(deadline - time.monotonic())) if deadline != float("inf") else None
    lines = [f"You are agent `{agent_id}`. Make the engine's forward pass faster, keeping it bitwise exact.",
             "Use the tkcc tools: read the source, submit candidates, check them with check_bit_exact and "
             "measure them with measure_fast; confirm a winner with measure_full."]
    if left is not None:
        lines.append(f"Time budget: about {left} s from now.")
    if max_experiments:
        lines.append(f"At most {max_experiments} submissions in total.")
    lines.append(f"Your working directory: {workdir}")
    if notes:
        lines.append("Keep notes.md there up to date (notes_read / notes_write).")
    r = resume or {}
    if r.get("experiments"):
        lines.append(f"You are resuming: you already submitted {r['experiments']} candidates"
                     + (f"; your best exact one is {r['best_id']} at {r['best_speedup']:.3f}x on the fast tier"
                        if r.get("best_id") else "; none of them beat the reference yet") + ".")
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


def window(messages: list[dict], k: int) -> list[dict]:
    """messages[0] (the task) + the last k exchanges; a note says how many were dropped."""
    if len(messages) <= 1 + 2 * k:
        return messages
    tail = messages[-2 * k:] if k > 0 else []
    if tail and tail[0]["role"] != "assistant":  # start on an assistant turn so roles alternate
        tail = tail[1:]
    dropped = (len(messages) - 1 - len(tail)) // 2
    first = copy.deepcopy(messages[0])
    note = f"\n\n({dropped} earlier tool exchange(s) were dropped from your context; re-read what you need.)"
    if isinstance(first["content"], str):
        first["content"] += note
    else:
        first["content"] = list(first["content"]) + [{"type": "text", "text": note.strip()}]
    return [first] + tail


def digest(board: dict | None, agent_id: str, resume: dict | None, notes_text: str | None = None,
           limit: int = 8) -> str:
    """The leaderboard and the agent's own position, as a fresh context's starting point."""
    rows = [r for r in (board or {}).get("rows", []) if r.get("exact")][:limit]
    out = ["Leaderboard digest (exact candidates, fast-tier speedup over the reference):"]
    if rows:
        out += [f"- {r['candidate_id']} {r.get('speedup', 0):.3f}x by {r.get('agent_id')}: {r.get('name')}"
                for r in rows]
    else:
        out.append("- no exact candidate has been measured yet")
    mine = [r for r in rows if r.get("agent_id") == agent_id]
    if mine:
        out.append(f"Your best: {mine[0]['candidate_id']} at {mine[0]['speedup']:.3f}x; read it with "
                   f"candidate_source and improve it (parent={mine[0]['candidate_id']}).")
    elif (resume or {}).get("best_id"):
        out.append(f"Your best: {resume['best_id']} at {resume['best_speedup']:.3f}x.")
    if notes_text:
        out += ["", "Your notes.md:", notes_text[-4000:]]
    return "\n".join(out)


def summarise_source(text: str) -> str:
    """Module docstring, imports, signatures, docstrings and comment lines; bodies elided."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines()
    keep: set[int] = set()
    elided: dict[int, int] = {}  # line index after which "..." goes -> body lines elided

    def visit(body, depth):
        for node in body:
            start, end = node.lineno - 1, node.end_lineno - 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = node.body[0]
                head_end = first.lineno - 2  # the signature may span lines
                for d in node.decorator_list:
                    start = min(start, d.lineno - 1)
                keep.update(range(start, head_end + 1))
                rest, body_start = node.body, head_end + 1
                if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                        and isinstance(first.value.value, str):
                    keep.update(range(first.lineno - 1, first.end_lineno))
                    rest, body_start = node.body[1:], first.end_lineno
                if isinstance(node, ast.ClassDef):
                    visit(rest, depth + 1)
                elif rest:
                    body_lines = range(body_start, end + 1)
                    comments = {i for i in body_lines if lines[i].strip().startswith("#")}
                    keep.update(comments)
                    code = [i for i in body_lines if i not in comments and lines[i].strip()]
                    if code:
                        elided[code[0]] = len(code)
            else:
                keep.update(range(start, end + 1))

    visit(tree.body, 0)
    out, skipping = [], False
    for i, ln in enumerate(lines):
        if i in elided:
            indent = len(lines[i]) - len(lines[i].lstrip())
            out.append(" " * (7 + indent) + f"...  # {elided[i]} lines elided: read this range for the code")
        if i in keep:
            out.append(f"{i + 1:5d}  {ln}")
            skipping = False
        elif not skipping and not ln.strip():
            out.append("")
            skipping = True
    return "\n".join(out)
