"""Tests for engine_server.traffic: real traces, malformed files, prompts, token ids, profile."""
import csv
import json
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from engine_server import traffic as T

SHARED = Path("/work/shared/data")
PACKAGED = T.DATA_DIR
AZURE, MOONCAKE = "azure_llm_2023_code.csv", "mooncake_fast25_synthetic_trace.jsonl"
TRACE_DIRS = [PACKAGED / "traces"] + ([SHARED / "traces"] if (SHARED / "traces").is_dir() else [])


# ------------------------------------------------------------------ real traces

@pytest.mark.parametrize("d", TRACE_DIRS, ids=str)
def test_azure_code_trace(d):
    tr = T.read_trace(d / AZURE)
    assert tr.format == "azure_llm_2023" and tr.source == str(d / AZURE)
    assert len(tr.requests) == 8819
    # first rows: 2023-11-16 18:17:03.9799600,4808,10 / 18:17:04.0319600,3180,8
    assert tr.requests[0] == T.Request(0.0, 4808, 10)
    assert tr.requests[1].prompt_len == 3180 and tr.requests[1].output_len == 8
    assert tr.requests[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    # last row: 2023-11-16 19:14:19.9280160,549,173
    assert tr.requests[-1].arrival_s == pytest.approx(57 * 60 + 16 - 0.05194, abs=1e-4)
    arr = [r.arrival_s for r in tr.requests]
    assert arr == sorted(arr)


@pytest.mark.parametrize("d", TRACE_DIRS, ids=str)
def test_mooncake_trace(d):
    tr = T.read_trace(d / MOONCAKE)
    assert tr.format == "mooncake" and len(tr.requests) == 3993
    assert tr.requests[0] == T.Request(0.0, 40160, 6)
    assert tr.requests[1] == T.Request(0.0, 36640, 4)
    with open(d / MOONCAKE) as f:
        last_ms = max(json.loads(line)["timestamp"] for line in f)
    assert tr.requests[-1].arrival_s == pytest.approx(last_ms / 1000)


def test_packaged_data_matches_shared():
    if not SHARED.is_dir():
        pytest.skip("no /work/shared/data")
    for sub, names in (("traces", [AZURE, MOONCAKE]), ("prompts", [p.name for p in T.DEFAULT_PROMPTS])):
        for name in names:
            assert (PACKAGED / sub / name).read_bytes() == (SHARED / sub / name).read_bytes()
        assert (PACKAGED / sub / "ATTRIBUTION.md").read_bytes() == (SHARED / sub / "README.md").read_bytes()
    assert T.DEFAULT_TRACE == PACKAGED / "traces" / AZURE and T.DEFAULT_TRACE.is_file()


def test_limit_keeps_first_rows():
    tr = T.read_trace(T.DEFAULT_TRACE, limit=5)
    assert len(tr.requests) == 5 and tr.requests[0] == T.Request(0.0, 4808, 10)
    with pytest.raises(ValueError):
        T.read_trace(T.DEFAULT_TRACE, limit=0)


# ------------------------------------------------------------------ malformed files

AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:17:03.9799600,4808,10\n"
MC_OK = '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [0]}\n'


@pytest.mark.parametrize("name,text,line,word", [
    ("missing_col.csv", AZ_HEAD + AZ_OK + "2023-11-16 18:17:04.0,3180\n", 3, "GeneratedTokens"),
    ("extra_col.csv", AZ_HEAD + AZ_OK + "2023-11-16 18:17:04.0,3180,8,9\n", 3, "columns"),
    ("non_numeric.csv", AZ_HEAD + AZ_OK + AZ_OK + "2023-11-16 18:17:04.0,abc,8\n", 4, "ContextTokens"),
    ("negative.csv", AZ_HEAD + "2023-11-16 18:17:04.0,5,-8\n", 2, "GeneratedTokens"),
    ("fraction.csv", AZ_HEAD + "2023-11-16 18:17:04.0,5.5,8\n", 2, "ContextTokens"),
    ("bad_time.csv", AZ_HEAD + AZ_OK + "16/11/2023 18:17,5,8\n", 3, "TIMESTAMP"),
    ("bad_date.csv", AZ_HEAD + "2023-13-16 18:17:04.0,5,8\n", 2, "TIMESTAMP"),
    ("blank_lines.csv", AZ_HEAD + AZ_OK + "\n\n" + "x,1,2\n", 5, "TIMESTAMP"),
    ("unknown_header.csv", "time,in,out\n1,2,3\n", 1, "header"),
    ("empty.csv", "", 1, "empty"),
    ("header_only.csv", AZ_HEAD, None, "no data rows"),
    ("bad_json.jsonl", MC_OK + "{not json\n", 2, "JSON"),
    ("missing_key.jsonl", MC_OK + MC_OK + '{"timestamp": 3, "input_length": 5}\n', 3, "output_length"),
    ("neg_json.jsonl", MC_OK + '{"timestamp": 3, "input_length": -5, "output_length": 1}\n', 2, "input_length"),
    ("str_json.jsonl", MC_OK + '{"timestamp": "soon", "input_length": 5, "output_length": 1}\n', 2, "timestamp"),
    ("bool_json.jsonl", MC_OK + '{"timestamp": 1, "input_length": true, "output_length": 1}\n', 2, "input_length"),
    ("nan_log.jsonl", '{"arrival_s": NaN, "prompt_len": 1, "output_len": 1}\n', 1, "arrival_s"),
    ("array.jsonl", MC_OK + "[1, 2, 3]\n", 2, "object"),
    ("unknown_keys.jsonl", '{"t": 1, "p": 2, "o": 3}\n', 1, "unknown"),
])
def test_malformed_rows_name_file_and_line(tmp_path, name, text, line, word):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(T.TraceError) as ei:
        T.read_trace(path)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert msg.startswith(f"{path}:{line}:" if line else f"{path}:"), msg
    assert word.lower() in msg.lower(), msg


def test_limit_stops_before_a_later_bad_row(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZ_HEAD + AZ_OK + AZ_OK + "garbage\n")
    assert len(T.read_trace(path, limit=2).requests) == 2


# ------------------------------------------------------------------ other formats

def test_burstgpt_sample(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10.5,ChatGPT,472,18,490,Conversation log\n"
        "8,GPT-4,1010,0,1010,API log\n"          # earlier arrival, failed request (0 output)
        '12.25,"Chat,GPT",30,200,230,Conversation log\n')
    tr = T.read_trace(path)
    assert tr.format == "burstgpt"
    assert tr.requests == [T.Request(0.0, 1010, 0), T.Request(2.5, 472, 18), T.Request(4.25, 30, 200)]


def test_serving_log(tmp_path):
    path = tmp_path / "serving.log"   # detected from content, not the extension
    rows = [{"arrival_s": 100.5, "prompt_len": 7, "output_len": 3, "id": "b"},
            {"arrival_s": 100.0, "prompt_len": 9, "output_len": 4, "ttft_s": 0.1},
            {"arrival_s": 100.5, "prompt_len": 1, "output_len": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tr = T.read_trace(path)
    assert tr.format == "serving_log"
    # sorted, starts at 0, ties keep file order (stable)
    assert tr.requests == [T.Request(0.0, 9, 4), T.Request(0.5, 7, 3), T.Request(0.5, 1, 1)]


# ------------------------------------------------------------------ prompts and tokens

@pytest.fixture(scope="module")
def prompts():
    return T.load_prompts()


def test_load_prompts(prompts, tmp_path):
    assert len(prompts) == 500 + 375 + 80
    assert prompts[0] == "Use ABC notation to write a melody in the style of a folk tune."
    mt = json.loads((PACKAGED / "prompts" / "mt_bench_questions.jsonl").read_text().splitlines()[0])
    assert prompts[500 + 375] == "\n".join(mt["turns"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"uid": 1}\n')
    with pytest.raises(T.TraceError, match=rf"{bad}:2:"):
        T.load_prompts([bad])


def test_fallback_tokenizer_deterministic_and_in_range(prompts):
    tok = T.load_tokenizer(None, 32000)
    assert tok.name == T.FALLBACK_NAME and tok.vocab_size == 32000
    text = "def f(x_1):\n    return x_1 * 12345  # héllo, 世界!"
    ids = tok.encode(text)
    assert ids == T.load_tokenizer(None, 32000).encode(text)   # fresh instance, same ids
    assert all(0 <= i < 32000 for i in ids) and len(ids) > 5
    assert tok.encode("a") == [ord("a")]                       # single bytes keep their value
    for p in prompts:                                           # pieces cover the whole text
        assert "".join(T._PIECE.findall(p)) == p
    small = T.load_tokenizer(None, 100)
    assert all(0 <= i < 100 for i in small.encode(text))
    # Same ids in another process with a different str-hash salt (no use of hash()).
    code = ("from engine_server import traffic as T;"
            f"print(T.load_tokenizer(None, 32000).encode({text!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == ids


def _fake_tokenizers(monkeypatch, ids):
    class Fake:
        @staticmethod
        def from_file(path):
            return Fake()

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return types.SimpleNamespace(ids=list(ids))
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=Fake))


def test_hf_tokenizer_path_and_range_check(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    _fake_tokenizers(monkeypatch, [1, 2, 99])
    tok = T.load_tokenizer(tmp_path, 100)
    assert tok.name.startswith("hf:") and tok.encode("x") == [1, 2, 99]
    with pytest.raises(ValueError, match="outside the model's vocab_size 50"):
        T.load_tokenizer(tmp_path, 50).encode("x")
    monkeypatch.setitem(sys.modules, "tokenizers", None)     # package not installed
    with pytest.warns(UserWarning, match="tokenizers"):
        assert T.load_tokenizer(tmp_path, 100).name == T.FALLBACK_NAME


def test_token_ids_for(prompts):
    tok = T.load_tokenizer(None, 32000)
    for n in (0, 1, 7, 300, 50_000):
        ids = T.token_ids_for(n, tok, prompts, index=3)
        assert len(ids) == n and all(0 <= i < 32000 for i in ids)
    a = T.token_ids_for(2000, tok, prompts, 3)
    assert a == T.token_ids_for(2000, T.load_tokenizer(None, 32000), prompts, 3 + len(prompts))
    first = tok.encode(prompts[3])
    assert a[:len(first)] == first and a[len(first)] == tok.encode("\n")[0]
    assert a != T.token_ids_for(2000, tok, prompts, 4)
    # Wraps around a tiny corpus.
    assert T.token_ids_for(7, tok, ["a b", "c"], 1) == tok.encode("c\na b\nc\na b")[:7]
    with pytest.raises(ValueError):
        T.token_ids_for(5, tok, [], 0)


def test_random_token_ids_labelled_option():
    a = T.random_token_ids(1000, 500, seed=1)
    assert a == T.random_token_ids(1000, 500, seed=1) != T.random_token_ids(1000, 500, seed=2)
    assert len(a) == 1000 and all(0 <= i < 500 for i in a)
    assert "labelled" in T.random_token_ids.__doc__


# ------------------------------------------------------------------ profile and shapes

def test_profile_azure_code():
    with open(T.DEFAULT_TRACE, newline="") as f:
        rows = list(csv.DictReader(f))
    ctx = [int(r["ContextTokens"]) for r in rows]
    gen = [int(r["GeneratedTokens"]) for r in rows]
    prof = T.profile(T.read_trace(T.DEFAULT_TRACE))
    assert prof.requests == 8819 and prof.format == "azure_llm_2023"
    assert prof.prompt_len.p50 == statistics.median(ctx)
    assert prof.output_len.p50 == statistics.median(gen)
    for q in ("p10", "p90", "p99"):
        assert getattr(prof.prompt_len, q) == pytest.approx(np.quantile(ctx, int(q[1:]) / 100))
    assert prof.prompt_len.max == max(ctx) and prof.prompt_len.mean == pytest.approx(np.mean(ctx))
    assert prof.duration_s == pytest.approx(3435.948, abs=1e-3)
    assert prof.arrival_rate == pytest.approx(8819 / 3435.948, rel=1e-6)
    w = np.mean(ctx) / 5000 + np.mean(gen) / 50
    assert prof.concurrency == pytest.approx(prof.arrival_rate * w)
    json.dumps(prof.to_dict())


def test_profile_all_at_once():
    tr = T.Trace([T.Request(0.0, 4, 2)] * 3, "x", "serving_log")
    prof = T.profile(tr)
    assert prof.arrival_rate == 0.0 and prof.concurrency == 3.0 and prof.duration_s == 0.0


def test_cap():
    tr = T.read_trace(T.DEFAULT_TRACE)
    c = T.cap(tr, max_prompt=1024, max_output=5, max_requests=100)
    assert len(c.requests) == 100 and c.source == tr.source and c.format == tr.format
    assert all(1 <= r.prompt_len <= 1024 and 1 <= r.output_len <= 5 for r in c.requests)
    assert [r.arrival_s for r in c.requests] == [r.arrival_s for r in tr.requests[:100]]
    rec = c.capped[-1]
    assert rec["requests_dropped"] == 8719 and rec["max_prompt"] == 1024
    assert rec["prompts_clipped"] == sum(r.prompt_len > 1024 for r in tr.requests[:100])
    assert len(tr.requests) == 8819 and tr.capped == ()       # input untouched
    z = T.cap(T.Trace([T.Request(0.0, 0, 0)], "x", "burstgpt"))
    assert z.requests == [T.Request(0.0, 1, 1)]
    assert T.profile(c).capped == [rec]
    with pytest.raises(ValueError):
        T.cap(tr, max_prompt=0)


def test_sample_lengths():
    tr = T.read_trace(T.DEFAULT_TRACE)
    s = T.sample_lengths(tr, 10, seed=0)
    assert s == T.sample_lengths(tr, 10, seed=0) and len(s) == 10
    lens = sorted(r.prompt_len for r in tr.requests)
    assert [r.prompt_len for r in s] == sorted(r.prompt_len for r in s)
    assert s[0].prompt_len <= lens[len(lens) // 10] and s[-1].prompt_len >= lens[9 * len(lens) // 10 - 1]
    assert all(r in tr.requests for r in s)
    assert len(T.sample_lengths(tr, 10**6, seed=0)) == 8819
