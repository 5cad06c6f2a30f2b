"""Real traffic for tkcc measurements: traces give shapes, real prompt text gives token ids.

Contract
--------
* ``read_trace(path, limit=None) -> Trace`` reads one of four formats, detected from the
  extension and the header / first line:
    - Azure LLM inference 2023 CSV  ``TIMESTAMP,ContextTokens,GeneratedTokens``
    - Mooncake JSONL                ``{"timestamp": ms, "input_length", "output_length", ...}``
    - BurstGPT CSV                  ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
    - the engine's serving log      ``{"arrival_s": s, "prompt_len", "output_len", ...}`` (JSONL)
  Requests come back sorted by arrival (stable: ties keep file order), the first at 0.0 s.
  ``limit`` keeps the first ``limit`` data rows of the file. Lengths are integers >= 0 (0 is
  kept as read; ``cap`` raises it to 1). Anything malformed raises ``TraceError`` whose
  message starts with ``file:line`` (1-based, as an editor shows it).
* Token ids are real text: ``load_prompts`` + ``load_tokenizer`` + ``token_ids_for`` give, for
  a (length, index), the same ids on every machine and run. ``random_token_ids`` exists only
  for the labelled random-input comparison.
* ``profile`` summarises a trace; ``sample_lengths`` and ``cap`` derive the shapes the fast
  and full measurement tiers run. Data ships in ``DATA_DIR`` (licenses in its ATTRIBUTION.md).
"""
from __future__ import annotations

import csv
import functools
import hashlib
import itertools
import json
import math
import random
import re
import warnings
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from pydantic import BaseModel

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRACE = DATA_DIR / "traces" / "azure_llm_2023_code.csv"
DEFAULT_PROMPTS = tuple(DATA_DIR / "prompts" / name for name in (
    "arena_hard_v0.1_questions.jsonl",
    "arena_hard_v2.0_questions_every2nd.jsonl",
    "mt_bench_questions.jsonl",
))


class TraceError(ValueError):
    """A trace or prompt file that cannot be used; the message starts with ``file:line``."""


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float  # seconds from trace start
    prompt_len: int   # tokens
    output_len: int   # tokens


@dataclass(frozen=True)
class Trace:
    requests: list[Request]
    source: str   # the file it was read from
    format: str   # "azure_llm_2023" | "mooncake" | "burstgpt" | "serving_log"
    capped: tuple[dict, ...] = ()  # one record per cap(): results must say what was cut


# ---------------------------------------------------------------- readers

def _number(value, what: str) -> float:
    # bool is an int subclass in Python; a JSON true is never a time or a length.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what}: not a number: {value!r}")
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"{what}: not a number: {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{what}: not finite: {value!r}")
    return x


def _length(value, what: str) -> int:
    x = _number(value, what)
    if x < 0 or x != int(x):
        raise ValueError(f"{what}: must be an integer >= 0, got {value!r}")
    return int(x)


_AZURE_TS = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?")


def _azure_time(text: str) -> float:
    # Azure writes 7 fractional digits (100 ns ticks); fromisoformat only promises 6, so
    # truncate. The time zone is not stated; only differences matter, so read it as UTC
    # (a local-time reading could jump at a DST change).
    m = _AZURE_TS.fullmatch(text.strip())
    try:
        if not m:
            raise ValueError("expected YYYY-MM-DD HH:MM:SS[.fffffff]")
        dt = datetime.fromisoformat(m[1] + ("." + m[2][:6].ljust(6, "0") if m[2] else ""))
    except ValueError as e:
        raise ValueError(f"TIMESTAMP: cannot parse {text!r} ({e})") from None
    return dt.replace(tzinfo=timezone.utc).timestamp()


# format -> (exact header, row -> (arrival_s, prompt_len, output_len))
_CSV_FORMATS: dict[str, tuple[list[str], Callable]] = {
    "azure_llm_2023": (["TIMESTAMP", "ContextTokens", "GeneratedTokens"], lambda r: (
        _azure_time(r[0]), _length(r[1], "ContextTokens"), _length(r[2], "GeneratedTokens"))),
    "burstgpt": (["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                  "Log Type"], lambda r: (
        _number(r[0], "Timestamp"), _length(r[2], "Request tokens"), _length(r[3], "Response tokens"))),
}
# format -> ((time key, prompt key, output key), seconds per time unit)
_JSON_FORMATS: dict[str, tuple[tuple[str, str, str], float]] = {
    "mooncake": (("timestamp", "input_length", "output_length"), 1e-3),  # milliseconds
    "serving_log": (("arrival_s", "prompt_len", "output_len"), 1.0),
}


def _rows(path: Path, numbered: Iterable[tuple[int, object]], parse: Callable) -> Iterator[Request]:
    for no, item in numbered:
        try:
            req = Request(*parse(item))
        except json.JSONDecodeError as e:  # its own message has a misleading "line 1"
            raise TraceError(f"{path}:{no}: not JSON ({e.msg})") from None
        except ValueError as e:
            raise TraceError(f"{path}:{no}: {e}") from None
        yield req


def _csv_rows(path: Path, header_line: str, rest: Iterable[str]) -> tuple[str, Iterator[Request]]:
    header = [c.strip() for c in next(csv.reader([header_line]))]
    fmt = next((f for f, (cols, _) in _CSV_FORMATS.items() if header == cols), None)
    if fmt is None:
        known = "; ".join(",".join(cols) for cols, _ in _CSV_FORMATS.values())
        raise TraceError(f"{path}:1: unknown CSV header {','.join(header)!r}; expected one of: {known}")
    cols, parse_cols = _CSV_FORMATS[fmt]
    reader = csv.reader(rest)

    def parse(row: list[str]):
        if len(row) < len(cols):
            raise ValueError(f"missing column(s) {', '.join(cols[len(row):])}")
        if len(row) > len(cols):
            raise ValueError(f"expected {len(cols)} columns, got {len(row)}")
        return parse_cols(row)

    # +1: the header line was consumed before the reader started counting; blank rows skipped.
    numbered = ((reader.line_num + 1, row) for row in reader if row)
    return fmt, _rows(path, numbered, parse)


def _json_rows(path: Path, first: str, rest: Iterable[str]) -> tuple[str, Iterator[Request]]:
    try:
        rec = json.loads(first)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:1: not JSON ({e.msg})") from None
    fmt = next((f for f, (keys, _) in _JSON_FORMATS.items()
                if isinstance(rec, dict) and keys[0] in rec), None)
    if fmt is None:
        known = "; ".join(",".join(keys) for keys, _ in _JSON_FORMATS.values())
        raise TraceError(f"{path}:1: unknown JSONL trace format; expected keys: {known}")
    keys, scale = _JSON_FORMATS[fmt]

    def parse(line: str):
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in keys if k not in rec]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(missing)}")
        return (_number(rec[keys[0]], keys[0]) * scale,
                _length(rec[keys[1]], keys[1]), _length(rec[keys[2]], keys[2]))

    lines = enumerate(itertools.chain([first], rest), 1)
    return fmt, _rows(path, ((no, ln) for no, ln in lines if ln.strip()), parse)


def read_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a trace file in any supported format (see module docstring)."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    # utf-8-sig: tolerate the BOM that spreadsheet exports put before a CSV header.
    with path.open(newline="", encoding="utf-8-sig") as f:
        first = f.readline()
        if not first.strip():
            raise TraceError(f"{path}:1: empty file (no header, no rows)")
        is_json = (path.suffix.lower() in {".jsonl", ".json", ".ndjson", ".log"}
                   or first.lstrip().startswith("{"))
        fmt, rows = (_json_rows if is_json else _csv_rows)(path, first, f)
        reqs = list(itertools.islice(rows, limit))  # stop reading at limit: big files stay cheap
    if not reqs:
        raise TraceError(f"{path}: no data rows")
    reqs.sort(key=lambda r: r.arrival_s)  # list.sort is stable
    t0 = reqs[0].arrival_s
    return Trace([replace(r, arrival_s=r.arrival_s - t0) for r in reqs], str(path), fmt)


# ---------------------------------------------------------------- prompt text and token ids

def load_prompts(paths: Sequence[str | Path] | None = None) -> list[str]:
    """Prompt texts in file order: Arena-Hard ``prompt``; MT-bench ``turns`` joined by newlines."""
    out = []
    for path in map(Path, paths or DEFAULT_PROMPTS):
        with path.open(encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    text = rec["prompt"] if "prompt" in rec else "\n".join(rec["turns"])
                    if not isinstance(text, str):
                        raise TypeError("prompt is not a string")
                except (ValueError, KeyError, TypeError) as e:
                    raise TraceError(f"{path}:{no}: no prompt text ({e!r})") from None
                if text.strip():
                    out.append(text)
    return out


class Tokenizer:
    """Text -> ids in ``[0, vocab_size)``. Encodings are cached by text (the corpus is small
    and ``token_ids_for`` re-encodes the same prompts for every request)."""

    def __init__(self, name: str, vocab_size: int, encode_fn: Callable[[str], list[int]]):
        self.name, self.vocab_size, self._encode, self._cache = name, vocab_size, encode_fn, {}

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self._encode(text))
            bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"tokenizer {self.name} produced id {bad}, outside the model's "
                                 f"vocab_size {self.vocab_size}: tokenizer and model do not match")
            self._cache[text] = ids
        return list(ids)  # a copy: callers may mutate, the cache must not change


# Fallback pieces, GPT-2 style: an optional leading space + a letter run, up to 3 digits,
# or a punctuation run; underscores; whitespace runs (the last space is left to the next
# word). Every character falls in one of these classes, so the pieces cover the text.
_PIECE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\w\s]+|_+|\s+(?!\S)|\s+")
FALLBACK_NAME = "fallback-blake2b-v1"


def _fallback_encode(vocab_size: int) -> Callable[[str], list[int]]:
    """Deterministic stand-in for a real tokenizer (same text -> same ids everywhere).

    A piece that is one UTF-8 byte gets that byte's value (ids 0..255); any longer piece
    gets ``blake2b(piece, 8 bytes) % (vocab_size - 256) + 256``. blake2b, not ``hash()``,
    because ``hash()`` of str is salted per process. With ``vocab_size <= 256`` there is no
    room for pieces: every UTF-8 byte ``b`` becomes ``b % vocab_size``.
    """
    if vocab_size <= 256:
        return lambda text: [b % vocab_size for b in text.encode("utf-8")]
    span = vocab_size - 256

    @functools.lru_cache(maxsize=None)  # pieces repeat a lot; one cache per tokenizer
    def piece_id(piece: str) -> int:
        raw = piece.encode("utf-8")
        if len(raw) == 1:
            return raw[0]
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") % span + 256

    def encode(text: str) -> list[int]:
        return [piece_id(p) for p in _PIECE.findall(text)]
    return encode


def load_tokenizer(model_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The model's own ``tokenizer.json`` via the ``tokenizers`` package when both exist,
    else the documented fallback (its ``name`` says which one was used)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            warnings.warn(f"{path} found but the 'tokenizers' package is not installed; "
                          f"using {FALLBACK_NAME}")
        else:
            hf = HFTokenizer.from_file(str(path))
            # No special tokens: these ids stand for the body of a prompt.
            return Tokenizer(f"hf:{path}", vocab_size,
                             lambda text: hf.encode(text, add_special_tokens=False).ids)
    return Tokenizer(FALLBACK_NAME, vocab_size, _fallback_encode(vocab_size))


def token_ids_for(length: int, tokenizer: Tokenizer, prompts: Sequence[str], index: int) -> list[int]:
    """Exactly ``length`` ids of real text: prompt ``index % len(prompts)``, continued with
    the following prompts (wrapping around, each encoded on its own and joined by the ids
    of a newline) until long enough, then truncated."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not prompts:
        raise ValueError("no prompts")
    sep, start, ids = tokenizer.encode("\n"), index % len(prompts), []
    for step in itertools.count():
        if len(ids) >= length:
            return ids[:length]
        if step >= len(prompts) and not ids:  # would loop forever
            raise ValueError(f"prompt corpus encodes to no tokens with {tokenizer.name}")
        if ids:
            ids.extend(sep)
        ids.extend(tokenizer.encode(prompts[(start + step) % len(prompts)]))


def random_token_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Uniform random ids, ONLY for the labelled "random tokens" comparison.

    Measurements use real text (``token_ids_for``); random ids change what kernels see
    (no repetition, unnatural id spread), so a number produced with them must be labelled
    as such. Deterministic for a seed (``random.Random`` is stable across platforms)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


# ---------------------------------------------------------------- profile and shapes

class LengthStats(BaseModel):
    p10: float
    p50: float
    p90: float
    p99: float
    mean: float
    max: int


class TrafficProfile(BaseModel):
    source: str
    format: str
    requests: int
    duration_s: float     # last arrival - first arrival
    arrival_rate: float   # requests / s; 0.0 when every request arrives at t=0
    prompt_len: LengthStats
    output_len: LengthStats
    concurrency: float    # Little's law estimate of requests in flight, see profile()
    assumed_decode_tok_s: float
    assumed_prefill_tok_s: float
    capped: list[dict] = []

    def to_dict(self) -> dict:
        return self.model_dump()


def _stats(xs: list[int]) -> LengthStats:
    xs = sorted(xs)

    def q(p: float) -> float:  # linear interpolation = numpy's default / statistics "inclusive"
        pos = p * (len(xs) - 1)
        lo = int(pos)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)
    return LengthStats(p10=q(.1), p50=q(.5), p90=q(.9), p99=q(.99), mean=sum(xs) / len(xs), max=xs[-1])


def profile(trace: Trace, decode_tok_s: float = 50.0, prefill_tok_s: float = 5000.0) -> TrafficProfile:
    """Summarise a trace. ``concurrency`` is Little's law, L = arrival_rate * W, with W the
    mean time a request would spend in the engine at the assumed per-request speeds:
    ``mean(prompt_len) / prefill_tok_s + mean(output_len) / decode_tok_s``. It is an
    estimate of the batch the engine sees, clamped to the request count (and equal to it
    when all requests arrive at once); the assumptions are recorded in the profile."""
    reqs = trace.requests
    if not reqs:
        raise ValueError("empty trace")
    n, duration = len(reqs), reqs[-1].arrival_s - reqs[0].arrival_s
    p, o = _stats([r.prompt_len for r in reqs]), _stats([r.output_len for r in reqs])
    rate = n / duration if duration > 0 else 0.0
    w = p.mean / prefill_tok_s + o.mean / decode_tok_s
    conc = min(float(n), rate * w) if duration > 0 else float(n)
    return TrafficProfile(source=trace.source, format=trace.format, requests=n, duration_s=duration,
                          arrival_rate=rate, prompt_len=p, output_len=o, concurrency=conc,
                          assumed_decode_tok_s=decode_tok_s, assumed_prefill_tok_s=prefill_tok_s,
                          capped=list(trace.capped))


def sample_lengths(trace: Trace, n: int, seed: int = 0) -> list[Request]:
    """``n`` requests spread over the length distribution: sort by (prompt, output) length,
    cut into ``n`` equal-count strata, pick one request per stratum with ``Random(seed)``.
    Returned in ascending prompt length; all of them when ``n >= len(trace.requests)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    reqs = sorted(trace.requests, key=lambda r: (r.prompt_len, r.output_len, r.arrival_s))
    total = len(reqs)
    if n >= total:
        return reqs
    rng = random.Random(seed)
    return [reqs[rng.randrange(i * total // n, (i + 1) * total // n)] for i in range(n)]


def cap(trace: Trace, max_prompt: int | None = None, max_output: int | None = None,
        max_requests: int | None = None) -> Trace:
    """Clip lengths into ``[1, max]`` and keep the earliest ``max_requests`` requests (so
    the arrival pattern stays real). Appends a record of what was cut to ``trace.capped``."""
    for name, v in (("max_prompt", max_prompt), ("max_output", max_output), ("max_requests", max_requests)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")

    def clip(x: int, hi: int | None) -> int:
        return max(1, x if hi is None else min(x, hi))
    kept = trace.requests[:max_requests]
    out = [Request(r.arrival_s, clip(r.prompt_len, max_prompt), clip(r.output_len, max_output))
           for r in kept]
    record = {"max_prompt": max_prompt, "max_output": max_output, "max_requests": max_requests,
              "requests_dropped": len(trace.requests) - len(kept),
              "prompts_clipped": sum(a.prompt_len != b.prompt_len for a, b in zip(kept, out)),
              "outputs_clipped": sum(a.output_len != b.output_len for a, b in zip(kept, out))}
    return Trace(out, trace.source, trace.format, trace.capped + (record,))


@dataclass
class TrafficData:
    """What an engine keeps loaded: the trace, its profile, and real token ids on demand."""
    trace: Trace
    profile: TrafficProfile
    tokenizer: Tokenizer
    prompts: list[str]

    @classmethod
    def build(cls, path: str | Path, model_dir: Path | None, vocab_size: int) -> "TrafficData":
        trace = read_trace(path)
        return cls(trace, profile(trace), load_tokenizer(model_dir, vocab_size), load_prompts())

    def tokens(self, length: int, index: int) -> list[int]:
        """`length` real token ids from prompt `index` onwards (see token_ids_for)."""
        return token_ids_for(length, self.tokenizer, self.prompts, index)
