"""The ledger: every candidate, its source, every call and its result, who asked and when.

Contract: the ledger is written BEFORE a result is returned.
- Storage is one SQLite file in WAL mode. Every write method commits before it returns, so a
  returned call means the row survives `kill -9` of any process (engine server, worker,
  campaign harness, MCP server). `synchronous=FULL` (default) also survives power loss/host crash.
- Many processes and threads may write at once: each thread of each process gets its own
  connection (re-opened after fork), with a busy timeout; read-modify-write transactions use
  `BEGIN IMMEDIATE`, so `next_candidate_id()` is unique across processes.
- Candidate ids look like `c0001`; `add_candidate` with an existing id raises IntegrityError.
- A call is two writes: `start_call` (before the work) and `finish_call` (before returning).
  A call with `finished_at IS NULL` is one whose process died mid-call: that is evidence too.
- JSON columns (`calls.params`, `calls.result`, `events.data`) hold `json.dumps(default=str)`;
  non-finite floats are stored as the strings "nan"/"inf"/"-inf" so the text stays valid JSON.
- `leaderboard(metric)`: per candidate, the max numeric `$.speedup` over successful calls of
  `metric`, and `exact`: True/False from the latest finished `check_bit_exact` call
  (True only if that call succeeded and its `$.exact` is true), None if never checked.

Schema (version 1): candidates, calls, events, counters, schema_version.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, TextIO

SCHEMA_VERSION = 1
TABLES = ("candidates", "calls", "events")
_JSON_COLS = {"calls": ("params", "result"), "events": ("data",), "candidates": ()}
_UNSET: Any = object()

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS schema_version(version INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS candidates(id TEXT PRIMARY KEY, created_at REAL, name TEXT,
        parent TEXT, agent_id TEXT, source TEXT, source_hash TEXT, stage TEXT, ok INTEGER,
        error TEXT)""",
    """CREATE TABLE IF NOT EXISTS calls(id INTEGER PRIMARY KEY AUTOINCREMENT, started_at REAL,
        finished_at REAL, method TEXT, candidate_id TEXT, agent_id TEXT, params TEXT, ok INTEGER,
        result TEXT, error TEXT)""",
    """CREATE TABLE IF NOT EXISTS events(id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL,
        kind TEXT, candidate_id TEXT, agent_id TEXT, data TEXT)""",
    """CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS candidates_agent ON candidates(agent_id)",
    "CREATE INDEX IF NOT EXISTS candidates_hash ON candidates(source_hash)",
    "CREATE INDEX IF NOT EXISTS calls_candidate ON calls(candidate_id, method)",
    "CREATE INDEX IF NOT EXISTS calls_agent ON calls(agent_id)",
    "CREATE INDEX IF NOT EXISTS calls_method ON calls(method)",
    "CREATE INDEX IF NOT EXISTS events_kind ON events(kind)",
    "CREATE INDEX IF NOT EXISTS events_candidate ON events(candidate_id)",
]


class LedgerError(RuntimeError):
    """The ledger file cannot be used (not WAL-capable, or written by a newer schema)."""


def json_number(v: float) -> float | str:
    """A float as strict JSON has it: itself, or "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def strict_json(v: Any) -> Any:
    """`v` as valid strict JSON: non-finite floats as `json_number` writes them, non-str keys ->
    str (the ledger's text and the engine's HTTP answers both)."""
    if isinstance(v, float):
        return json_number(v)
    if isinstance(v, dict):
        return {k if isinstance(k, str) else str(k): strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def _dumps(v: Any) -> str | None:
    return None if v is None else json.dumps(strict_json(v), default=str, allow_nan=False)


def _row(table: str, r: sqlite3.Row, parse_json: bool = True) -> dict:
    d = dict(r)
    if "ok" in d and d["ok"] is not None:
        d["ok"] = bool(d["ok"])
    if parse_json:
        for col in _JSON_COLS.get(table, ()):
            if d.get(col) is not None:
                d[col] = json.loads(d[col])
    return d


class Ledger:
    """Thread- and process-safe SQLite ledger. `path` must be a file (not ':memory:')."""

    def __init__(self, path: str | os.PathLike, busy_timeout_s: float = 60.0,
                 synchronous: str = "FULL"):
        # WAL + NORMAL: a commit is in the OS page cache when it returns, so it survives kill -9
        # of any process (our threat), only power loss/kernel crash may drop the last commits.
        # WAL + FULL: also fsyncs the WAL on every commit, surviving power loss. Writes here are
        # a few per measurement (which takes seconds), so FULL costs nothing we would notice.
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be NORMAL, FULL or EXTRA, not {synchronous!r}")
        self.path = str(path)
        if self.path == ":memory:" or self.path.startswith("file:"):
            raise ValueError("the ledger needs a file path shared by all processes")
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self.synchronous = synchronous.upper()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[tuple[int, sqlite3.Connection]] = []  # (pid that opened it, conn)
        self._init()

    # -- connections and transactions -------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is not None and self._local.pid == os.getpid():
            return c
        # New thread, or a forked child: SQLite connections must not cross fork; an inherited
        # one stays referenced in self._conns (never used, never closed here).
        c = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                            check_same_thread=False)  # autocommit; close() may run elsewhere
        c.row_factory = sqlite3.Row
        c.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
        c.execute(f"PRAGMA synchronous={self.synchronous}")
        self._local.conn, self._local.pid = c, os.getpid()
        with self._lock:
            self._conns.append((os.getpid(), c))
        return c

    @contextlib.contextmanager
    def _tx(self):
        """A write transaction taken up front (no read->write upgrade, so no BUSY deadlock)."""
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:  # some errors already rolled back; never leave one open
                c.execute("ROLLBACK")
            raise

    def _init(self) -> None:
        c, deadline = self._conn(), time.monotonic() + self.busy_timeout_s
        while True:  # switching to WAL may report 'locked' while another process creates the file
            try:
                mode = c.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        if mode.lower() != "wal":
            raise LedgerError(f"{self.path}: cannot use WAL journal (got {mode!r})")
        with self._tx() as c:
            for stmt in _SCHEMA:
                c.execute(stmt)
            row = c.execute("SELECT MAX(version) FROM schema_version").fetchone()
            if row[0] is None:
                c.execute("INSERT INTO schema_version(version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] > SCHEMA_VERSION:
                raise LedgerError(f"{self.path}: schema v{row[0]} is newer than v{SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for pid, c in conns:
            if pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    c.close()
        self._local = threading.local()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writes (each commits before returning) -----------------------------------------------
    def next_candidate_id(self) -> str:
        """Reserve the next id `c0001`, `c0002`, ... unique across threads and processes."""
        with self._tx() as c:
            row = c.execute("SELECT value FROM counters WHERE name='candidate'").fetchone()
            top = c.execute("SELECT MAX(CAST(substr(id, 2) AS INTEGER)) FROM candidates "
                            "WHERE id GLOB 'c[0-9]*'").fetchone()[0]
            n = max(row[0] if row else 0, top or 0) + 1
            c.execute("INSERT INTO counters(name, value) VALUES ('candidate', ?) "
                      "ON CONFLICT(name) DO UPDATE SET value = excluded.value", (n,))
        return f"c{n:04d}"

    def add_candidate(self, id: str | None, source: str, name: str | None = None,
                      parent: str | None = None, agent_id: str | None = None) -> str:
        """Insert a candidate (id None: take `next_candidate_id()`); returns its id."""
        id = id or self.next_candidate_id()
        digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        self._conn().execute(
            "INSERT INTO candidates(id, created_at, name, parent, agent_id, source, source_hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)", (id, time.time(), name, parent, agent_id, source, digest))
        return id

    def update_candidate(self, id: str, stage: Any = _UNSET, ok: Any = _UNSET,
                         error: Any = _UNSET) -> None:
        """Set the given fields only (pass None to clear one)."""
        sets = {k: v for k, v in (("stage", stage), ("ok", ok), ("error", error)) if v is not _UNSET}
        if "ok" in sets and sets["ok"] is not None:
            sets["ok"] = int(bool(sets["ok"]))
        if sets:
            self._conn().execute(f"UPDATE candidates SET {', '.join(f'{k} = ?' for k in sets)} "
                                 "WHERE id = ?", (*sets.values(), id))

    def start_call(self, method: str, candidate_id: str | None = None,
                   agent_id: str | None = None, params: Any = None) -> int:
        cur = self._conn().execute(
            "INSERT INTO calls(started_at, method, candidate_id, agent_id, params) "
            "VALUES (?, ?, ?, ?, ?)", (time.time(), method, candidate_id, agent_id, _dumps(params)))
        return int(cur.lastrowid)

    def finish_call(self, call_id: int, ok: bool, result: Any = None,
                    error: str | None = None, candidate_id: str | None = None) -> None:
        """`candidate_id`, when given, fills in a candidate known only at the end (a submit)."""
        self._conn().execute(
            "UPDATE calls SET finished_at = ?, ok = ?, result = ?, error = ?, "
            "candidate_id = COALESCE(?, candidate_id) WHERE id = ?",
            (time.time(), int(bool(ok)), _dumps(result), error, candidate_id, call_id))

    def void_call(self, call_id: int, reason: str) -> None:
        """Withdraw a finished call's result (ok = 0, the reason as its error): an answer found
        later not to be the worker's own. Leaderboards and exactness read only ok calls."""
        self._conn().execute("UPDATE calls SET ok = 0, error = ? WHERE id = ?", (f"voided: {reason}", call_id))

    def record_event(self, kind: str, data: Any = None, candidate_id: str | None = None,
                     agent_id: str | None = None) -> int:
        """E.g. kind='worker_restart', data={'cost_s': 41.2, 'cause': 'SIGSEGV'}."""
        cur = self._conn().execute(
            "INSERT INTO events(at, kind, candidate_id, agent_id, data) VALUES (?, ?, ?, ?, ?)",
            (time.time(), kind, candidate_id, agent_id, _dumps(data)))
        return int(cur.lastrowid)

    # -- reads ---------------------------------------------------------------------------------
    def _select(self, table: str, where: dict[str, Any], cols: str = "*", limit: int | None = None,
                parse_json: bool = True) -> list[dict]:
        conds = {k: v for k, v in where.items() if v is not None}
        sql = f"SELECT {cols} FROM {table}"
        if conds:
            sql += " WHERE " + " AND ".join(f"{k} = ?" for k in conds)
        if limit is None:
            sql += " ORDER BY rowid"
        else:  # the latest `limit` rows, still returned oldest first
            sql += f" ORDER BY rowid DESC LIMIT {max(int(limit), 0)}"
        rows = self._conn().execute(sql, tuple(conds.values())).fetchall()
        rows = rows if limit is None else rows[::-1]
        return [_row(table, r, parse_json) for r in rows]

    def candidate(self, id: str) -> dict | None:
        rows = self._select("candidates", {"id": id})
        return rows[0] if rows else None

    def candidates(self, agent_id: str | None = None, with_source: bool = False) -> list[dict]:
        cols = "*" if with_source else ("id, created_at, name, parent, agent_id, source_hash, "
                                        "stage, ok, error")
        return self._select("candidates", {"agent_id": agent_id}, cols)

    def calls(self, candidate_id: str | None = None, agent_id: str | None = None,
              method: str | None = None, limit: int | None = None) -> list[dict]:
        return self._select("calls", {"candidate_id": candidate_id, "agent_id": agent_id,
                                      "method": method}, limit=limit)

    def events(self, kind: str | None = None, candidate_id: str | None = None) -> list[dict]:
        return self._select("events", {"kind": kind, "candidate_id": candidate_id})

    def leaderboard(self, metric: str = "measure_fast") -> list[dict]:
        sql = """
        WITH best AS (
          SELECT candidate_id, MAX(json_extract(result, '$.speedup')) AS speedup, COUNT(*) AS n
          FROM calls WHERE method = ? AND ok = 1 AND candidate_id IS NOT NULL
            AND json_type(result, '$.speedup') IN ('integer', 'real')
          GROUP BY candidate_id)
        SELECT b.candidate_id, c.name, c.agent_id, c.parent, b.speedup, b.n AS n_measurements,
          (SELECT k.ok = 1 AND COALESCE(json_extract(k.result, '$.exact'), 0) = 1
             FROM calls k WHERE k.candidate_id = b.candidate_id AND k.method = 'check_bit_exact'
               AND k.finished_at IS NOT NULL ORDER BY k.id DESC LIMIT 1) AS exact
        FROM best b LEFT JOIN candidates c ON c.id = b.candidate_id
        ORDER BY b.speedup DESC, b.candidate_id"""
        out = []
        for r in self._conn().execute(sql, (metric,)).fetchall():
            d = dict(r)
            d["exact"] = None if d["exact"] is None else bool(d["exact"])
            out.append(d)
        return out

    def export(self, fmt: str, table: str, out: TextIO, agent_id: str | None = None) -> int:
        """Write `table` (given an agent, its rows only) to `out` as JSON (a list, JSON columns
        parsed) or CSV (raw); row count."""
        if table not in TABLES or fmt not in ("json", "csv"):
            raise ValueError(f"export: fmt in ('json', 'csv'), table in {TABLES}")
        rows = self._select(table, {"agent_id": agent_id}, parse_json=fmt == "json")
        if fmt == "json":
            json.dump(rows, out, indent=1, default=str)
            out.write("\n")
        else:
            cols = [r[1] for r in self._conn().execute(f"PRAGMA table_info({table})")]
            w = csv.DictWriter(out, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
        return len(rows)


def format_table(rows: Iterable[dict], columns: list[str] | None = None, max_width: int = 40) -> str:
    """Fixed-width text table; long values are cut with '...'; None prints empty."""
    rows = list(rows)
    columns = columns or (list(rows[0]) if rows else [])

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            s = f"{v:.4g}" if abs(v) < 1e6 else f"{v:.0f}"
        else:
            s = str(v) if not isinstance(v, (dict, list)) else json.dumps(v, default=str)
        s = " ".join(s.split()) if "\n" in s or "\t" in s else s
        return s if len(s) <= max_width else s[: max_width - 3] + "..."

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    lines = [fmt(columns), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    return "\n".join(lines)
