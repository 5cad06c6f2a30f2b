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
    """Every readable .py file inside the snapshot, with its line count. Entries `read` would
    refuse (links that leave the snapshot, dangling or looping links, text that is not UTF-8)
    are left out, so one bad entry never hides the rest."""
    out = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = str((Path(dirpath) / f).relative_to(root))
            try:
                out.append({"path": rel, "lines": len(_text(resolve(root, rel)).splitlines())})
            except SnapshotError:
                continue
    return sorted(out, key=lambda d: d["path"])


def resolve(root: Path, path: str) -> Path:
    """The file `path` names inside the snapshot, or SnapshotError saying why not."""
    if not path or path.startswith(("/", "\\")) or Path(path).is_absolute():
        raise SnapshotError(f"path {_short(path)} must be relative to the snapshot")
    if ".." in Path(path).parts:
        raise SnapshotError(f"path {_short(path)} may not contain '..'")
    try:
        root = root.resolve()
        full = (root / path).resolve()  # follows links: one pointing outside is caught below
        if root != full and root not in full.parents:
            raise SnapshotError(f"path {_short(path)} leaves the snapshot")
        if not full.is_file():
            raise SnapshotError(f"no file {_short(path)} in the snapshot; call with no path to list files")
    except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, names too long, link loops
        if isinstance(e, SnapshotError):
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split(" from ")[0].split(":")[0]
        raise SnapshotError(f"path {_short(path)} cannot be read: {type(e).__name__}: {why}") from None
    return full


def _short(path: str) -> str:
    """`path` for a message: quoted, at most 120 characters (no engine path is ever shown)."""
    return repr(path) if len(path) <= 120 else repr(path[:100] + "...") + f" ({len(path)} characters)"


def _text(full: Path) -> str:
    try:
        return full.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{full.name} cannot be read: {type(e).__name__}: {e}") from None


def read(root: Path, path: str | None = None, start_line: int | None = None, end_line: int | None = None,
         reference: str | None = None) -> dict:
    """No path: the listing and which file holds the loaded model's reference forward pass.
    A path: numbered lines start_line..end_line (1-based, inclusive; at most MAX_LINES)."""
    if not path:
        return {"ok": True, "files": listing(root), "reference_forward": reference,
                "hint": "read the reference forward pass first; candidates define forward(state, batch) "
                        "and may import engine_server.models.* for the parts they leave alone"}
    try:
        lines = _text(resolve(root, path)).splitlines()
        start, end = _line_range(start_line, end_line, len(lines))
    except SnapshotError as e:
        return {"ok": False, "error": str(e)}
    text = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))
    return {"ok": True, "path": path, "start_line": start, "end_line": end, "total_lines": len(lines),
            "text": text, "truncated": end < len(lines)}


def _line_range(start_line: int | None, end_line: int | None, total: int) -> tuple[int, int]:
    """The lines to return, 1-based and inclusive: start_line (default 1) to end_line (default
    the last), at most MAX_LINES; a range that holds no line of the file is an error."""
    start = 1 if start_line is None else start_line
    if start < 1 or (end_line is not None and end_line < start):
        raise SnapshotError(f"lines {start_line}..{end_line} are not a range: start_line >= 1 and "
                            f"end_line >= start_line (the file has {total} lines)")
    if start > max(total, 1):
        raise SnapshotError(f"start_line {start} is past the end: the file has {total} lines")
    return start, min(total, end_line or total, start + MAX_LINES - 1)
