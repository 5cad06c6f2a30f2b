"""Agent profiles: plain Markdown files with a YAML header, in `agent_profiles/`.

    ---
    name: expert-window
    extends: expert            # optional: inherit the header and prepend the parent's body
    description: ...
    source_view: raw           # raw | summary (whole-file reads summarised; ranges stay raw)
    notes: false               # the agent keeps notes.md in its working directory
    context: window            # full | window (last window_turns tool exchanges) | fresh
    window_turns: 6            #   (fresh: restart every fresh_every turns with a leaderboard digest)
    fresh_every: 12
    max_turns: 80              # model turns per run
    max_tokens: 8192           # per model response
    model: ""                  # a default model for this profile ("" = the campaign's --llm-model)
    ---
    The body: the system prompt (the strategy).

`load_profile("expert")` finds `agent_profiles/expert.md`; a path loads that file. Unknown
header keys and bad values raise `ProfileError` saying which and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

PROFILES_DIR = Path(__file__).resolve().parents[2] / "agent_profiles"
CHOICES = {"source_view": ("raw", "summary"), "context": ("full", "window", "fresh")}


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Profile:
    name: str
    prompt: str  # the Markdown body: the system prompt
    description: str = ""
    source_view: str = "raw"
    notes: bool = False
    context: str = "full"
    window_turns: int = 8
    fresh_every: int = 12
    max_turns: int = 60
    max_tokens: int = 8192
    model: str = ""
    extends: str = ""
    path: str = ""

    @property
    def strategy(self) -> str:
        """The context strategy in one word, as reports show it."""
        return {"window": f"window{self.window_turns}", "fresh": f"fresh{self.fresh_every}"}.get(
            self.context, self.context) + ("+notes" if self.notes else "") + (
            "+summary" if self.source_view == "summary" else "")


FIELDS = {f.name: f for f in dataclasses.fields(Profile)}
HEADER_KEYS = set(FIELDS) - {"prompt", "path"}


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.md"))


def _find(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    q = PROFILES_DIR / f"{name_or_path}.md"
    if q.is_file():
        return q
    raise ProfileError(f"no profile {name_or_path!r}: not a file, nor one of {', '.join(list_profiles())} "
                       f"in {PROFILES_DIR}")


def parse(text: str, source: str = "<text>") -> tuple[dict, str]:
    """(header, body) of a profile file."""
    if not text.startswith("---"):
        return {}, text.strip()
    parts = text.split("\n---", 1)
    if len(parts) != 2:
        raise ProfileError(f"{source}: the YAML header opened with '---' is never closed")
    try:
        header = yaml.safe_load(parts[0][3:]) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"{source}: bad YAML header: {e}") from None
    if not isinstance(header, dict):
        raise ProfileError(f"{source}: the header must be a mapping")
    body = parts[1].split("\n", 1)[1] if "\n" in parts[1] else ""
    return header, body.strip()


def load_profile(name_or_path: str, _seen: tuple = ()) -> Profile:
    path = _find(name_or_path)
    header, body = parse(path.read_text(), str(path))
    bad = set(header) - HEADER_KEYS
    if bad:
        raise ProfileError(f"{path}: unknown header key(s) {sorted(bad)}; allowed: {sorted(HEADER_KEYS)}")
    base: dict = {}
    if header.get("extends"):
        parent_name = str(header["extends"])
        if parent_name in _seen:
            raise ProfileError(f"{path}: 'extends' loops through {parent_name!r}")
        parent = load_profile(parent_name if not parent_name.endswith(".md") else str(path.parent / parent_name),
                              _seen + (parent_name,))
        base = {k: v for k, v in dataclasses.asdict(parent).items() if k not in ("name", "description", "path")}
        body = (parent.prompt + "\n\n" + body).strip()
    fields = base | {k: v for k, v in header.items()}
    fields.setdefault("name", path.stem)
    fields["extends"] = str(header.get("extends") or "")
    for k, v in list(fields.items()):
        if k in CHOICES and v not in CHOICES[k]:
            raise ProfileError(f"{path}: {k} must be one of {CHOICES[k]}, not {v!r}")
        want = FIELDS[k].type if k in FIELDS else None
        if want in ("int", int) and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ProfileError(f"{path}: {k} must be a positive integer, not {v!r}")
        if want in ("bool", bool) and not isinstance(v, bool):
            raise ProfileError(f"{path}: {k} must be true or false, not {v!r}")
        if want in ("str", str) and v is not None and not isinstance(v, str):
            fields[k] = str(v)
    fields["prompt"] = body
    fields["path"] = str(path)
    if not body:
        raise ProfileError(f"{path}: the body (the system prompt) is empty")
    return Profile(**fields)
