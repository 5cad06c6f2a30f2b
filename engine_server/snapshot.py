"""Source snapshots: the raw engine source agents read through `read_engine_source`.

`source_snapshots/` mirrors the files of `engine_server/` that define what a forward pass
sees and how it is judged (FILES below). `regenerate()` rewrites it; `stale()` lists what is
out of date (a test fails on it). `read()` never leaves the snapshot: `..`, absolute paths
and links that point outside are refused.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT_DIR = ROOT / "source_snapshots"
FILES = [
    "engine_server/state.py", "engine_server/config.py",
    "engine_server/models/__init__.py", "engine_server/models/common.py", "engine_server/models/llama.py",
    "engine_server/models/moe.py", "engine_server/models/gpt2.py",
    "engine_server/measure.py", "engine_server/exact.py", "engine_server/greedy.py", "engine_server/guards.py",
    "engine_server/graphs.py", "engine_server/candidate.py",
]
MAX_LINES = 400  # per read; ask again with start_line for more


class SnapshotError(ValueError):
    pass


def regenerate(dest: Path = SNAPSHOT_DIR) -> list[str]:
    written = []
    for rel in FILES:
        src = ROOT / rel
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text()
        if not out.exists() or out.read_text() != text:
            out.write_text(text)
            written.append(rel)
    return written


def stale(dest: Path = SNAPSHOT_DIR) -> list[str]:
    return [rel for rel in FILES if not (dest / rel).exists() or (dest / rel).read_text() != (ROOT / rel).read_text()]


def listing(root: Path) -> list[dict]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            p = Path(dirpath) / f
            if p.suffix != ".py":
                continue
            out.append({"path": str(p.relative_to(root)), "lines": len(p.read_text().splitlines())})
    return sorted(out, key=lambda d: d["path"])


def resolve(root: Path, path: str) -> Path:
    if not path or path.startswith(("/", "\\")) or Path(path).is_absolute():
        raise SnapshotError(f"path {path!r} must be relative to the snapshot")
    if ".." in Path(path).parts:
        raise SnapshotError(f"path {path!r} may not contain '..'")
    root = root.resolve()
    full = (root / path).resolve()  # follows links: one pointing outside is caught below
    if root != full and root not in full.parents:
        raise SnapshotError(f"path {path!r} leaves the snapshot")
    if not full.is_file():
        raise SnapshotError(f"no file {path!r} in the snapshot; call with no path to list files")
    return full


def read(root: Path, path: str | None = None, start_line: int | None = None, end_line: int | None = None,
         reference: str | None = None) -> dict:
    """No path: the listing and which file holds the loaded model's reference forward pass.
    A path: numbered lines start_line..end_line (1-based, inclusive; at most MAX_LINES)."""
    if not path:
        return {"ok": True, "files": listing(root), "reference_forward": reference,
                "hint": "read the reference forward pass first; candidates define forward(state, batch) "
                        "and may import engine_server.models.* for the parts they leave alone"}
    try:
        full = resolve(root, path)
    except SnapshotError as e:
        return {"ok": False, "error": str(e)}
    lines = full.read_text().splitlines()
    start = max(1, start_line or 1)
    end = min(len(lines), end_line or len(lines), start + MAX_LINES - 1)
    text = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))
    return {"ok": True, "path": path, "start_line": start, "end_line": end, "total_lines": len(lines),
            "text": text, "truncated": end < len(lines)}
