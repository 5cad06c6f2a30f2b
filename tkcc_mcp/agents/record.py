"""What the harness records of one agent, in its working directory `DIR/agents/<id>/`.

- `calls.jsonl`: one line per tool call, appended as it finishes (survives kill -9):
  {"t": wall time, "tool": short name, "ok": bool, "seconds": s, "error": str|null, "run": n}
- `record.json`: the running totals, rewritten after every turn and call: kind, profile,
  context strategy, model, tokens (input, output, cache reads and writes), turns, tool-call
  counts, errors (each {"t", "kind", "message"}), status, and one entry per run (a resume
  starts a new run; totals carry over).

Tool names are recorded short (`submit_forward_pass`, not `mcp__tkcc__submit_forward_pass`).
Errors are data: an API failure, a malformed tool input or a crashed agent is appended here
and the harness carries on with the other agents.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine_server.client import write_atomic

TOKEN_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def short_tool(name: str) -> str:
    return name.rsplit("__", 1)[-1]


@dataclass
class AgentRecord:
    agent_id: str
    kind: str  # search | claude | anthropic
    profile: str
    context: str = "full"  # the context strategy actually used
    model: str = ""
    workdir: str = ""
    tokens: dict = field(default_factory=lambda: {k: 0 for k in TOKEN_KEYS})
    cost_usd: float = 0.0
    turns: int = 0
    tool_calls: dict = field(default_factory=dict)  # short name -> count
    tool_errors: int = 0
    errors: list = field(default_factory=list)
    status: str = "new"  # new | running | done | stopped | error
    runs: list = field(default_factory=list)  # [{"started": t, "ended": t|None, "status": ...}]
    notes: list = field(default_factory=list)  # e.g. "window not supported by claude: ran as full"

    # ---- persistence -------------------------------------------------------------------
    @classmethod
    def open(cls, workdir: Path, agent_id: str, kind: str, profile: str, **kw) -> "AgentRecord":
        """Load `record.json` from `workdir` (a resume), or start one; then begin a new run."""
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "record.json"
        rec = None
        if path.exists():
            try:
                d = json.loads(path.read_text())
                rec = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
            except (ValueError, TypeError):
                rec = None  # a torn file: start over, calls.jsonl still holds the calls
        if rec is None:
            rec = cls(agent_id=agent_id, kind=kind, profile=profile)
        rec.kind, rec.profile, rec.workdir = kind, profile, str(workdir)
        for k, v in kw.items():
            setattr(rec, k, v)
        for k in TOKEN_KEYS:
            rec.tokens.setdefault(k, 0)
        rec.runs.append({"started": time.time(), "ended": None, "status": "running"})
        rec.status = "running"
        rec.save()
        return rec

    @property
    def dir(self) -> Path:
        return Path(self.workdir)

    @property
    def run(self) -> int:
        return len(self.runs)

    def save(self) -> None:
        if not self.workdir:
            return
        write_atomic(self.dir / "record.json", json.dumps(asdict(self), indent=1, default=str))

    # ---- events ------------------------------------------------------------------------
    def tool_call(self, name: str, ok: bool, seconds: float, error: str | None = None) -> None:
        short = short_tool(name)
        self.tool_calls[short] = self.tool_calls.get(short, 0) + 1
        if not ok:
            self.tool_errors += 1
        if self.workdir:
            with open(self.dir / "calls.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "tool": short, "ok": ok, "seconds": round(seconds, 4),
                                    "error": (error or None) and str(error)[:500], "run": self.run}) + "\n")
        self.save()

    def usage(self, usage: dict | None, cost_usd: float | None = None) -> None:
        """Add one response's (or one session's) token usage."""
        for k in TOKEN_KEYS:
            v = (usage or {}).get(k)
            if isinstance(v, (int, float)):
                self.tokens[k] = self.tokens.get(k, 0) + int(v)
        if cost_usd:
            self.cost_usd += float(cost_usd)
        self.save()

    def error(self, kind: str, message: str) -> None:
        self.errors.append({"t": time.time(), "kind": kind, "message": str(message)[:2000], "run": self.run})
        self.save()

    def finish(self, status: str) -> None:
        self.status = status
        if self.runs:
            self.runs[-1].update(ended=time.time(), status=status)
        self.save()

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.get(k, 0) for k in TOKEN_KEYS)


def missing_credentials() -> str | None:
    """Why a model agent cannot call the API, or None (a key, a token, or a base URL such as the
    scripted API's)."""
    if any(os.environ.get(k) for k in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL")):
        return None
    return ("no ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) in the environment; set one, or set "
            "ANTHROPIC_BASE_URL to an API such as tkcc_mcp.scripted_api for offline runs")


def read_calls(workdir: Path) -> list[dict]:
    """The agent's `calls.jsonl` (a torn last line is skipped)."""
    path = Path(workdir) / "calls.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def read_record(workdir: Path) -> dict | None:
    try:
        return json.loads((Path(workdir) / "record.json").read_text())
    except (OSError, ValueError):
        return None
