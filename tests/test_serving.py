"""`tkcc serve`: the OpenAI-compatible API over real HTTP on 127.0.0.1, continuous batching,
the serving log, and hot swaps under load."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine_server import traffic
from engine_server.engine import EngineConfig
from engine_server.serving import ServeConfig, Service, ServingServer, check_loopback
from tkcc_mcp import replay

DELEGATE = ("from engine_server.models import llama as ref\n\n"
            "def forward(state, batch):\n    return ref.forward(state, batch)\n")
# installs fine (warm-up stays at position <= 4), raises once a sequence is past position 40
LATE_FAILURE = ("from engine_server.models import llama as ref\n\ndef forward(state, batch):\n"
                "    if int(batch.positions.max()) > 40:\n        raise RuntimeError('late failure')\n"
                "    return ref.forward(state, batch)\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("serve")
    svc = Service(EngineConfig(model="llama-3.2-1b", shrink=True, device="cpu"), ServeConfig(home=str(home), port=0))
    srv = ServingServer(svc).start()
    yield srv
    srv.stop()


def sse(lines) -> list:
    """data: payloads of an SSE stream, [DONE] included as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            d = line[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


def test_models_health_and_loopback(server):
    m = httpx.get(server.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "llama-3.2-1b-shrunk"
    assert m["data"][0]["max_model_len"] == 512
    h = httpx.get(server.url + "/health").json()
    assert h["ok"] and h["active"] == "reference"
    assert server.url.startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("0.0.0.0")


def test_completions(server):
    body = {"model": "llama-3.2-1b-shrunk", "prompt": "Write a function that reverses a list.", "max_tokens": 6,
            "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 6
    ids = server.service.tokenizer.encode(body["prompt"])
    assert d["usage"]["prompt_tokens"] == len(ids)
    text = d["choices"][0]["text"]
    assert text.startswith("<") and text.count("<") == 6  # the fallback tokenizer: ids as text
    again = httpx.post(server.url + "/v1/completions", json=body | {"prompt": ids}).json()  # token ids work too
    assert again["choices"][0]["text"] == text  # greedy: the same tokens
    sampled = httpx.post(server.url + "/v1/completions", json=body | {"temperature": 0.8, "seed": 3}).json()
    assert sampled["usage"]["completion_tokens"] == 6


def test_refusals_are_openai_errors(server):
    u = server.url + "/v1/completions"
    r = httpx.post(u, json={"prompt": list(range(600)), "max_tokens": 2})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(u, json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(u, json={"prompt": "hi", "n": 2}).status_code == 400
    assert httpx.post(u, json={"prompt": [99999]}).status_code == 400


def test_chat_streaming(server):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}],
            "max_tokens": 5, "temperature": 0}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5  # include_usage: the last chunk


def test_concurrent_requests_share_decode_steps(server):
    sched = server.service.scheduler
    before = len(sched.steps)

    def one(i):
        return httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": f"Request number {i}: explain caching.", "max_tokens": 12,
                                "temperature": 0, "ignore_eos": True})
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(one, range(8)))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12 for r in rs)
    rows = [s.rows for s in list(sched.steps)[before:]]
    assert max(rows) > 1, rows  # continuous batching: several requests decoded in one forward call
    metrics = httpx.get(server.url + "/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("tkcc_decode_rows_max "))
    assert int(line.split()[-1]) > 1


def test_metrics_text(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    text = httpx.get(server.url + "/metrics").text
    for name in ("tkcc_requests_total{", "tkcc_request_failures_total 0", "tkcc_prompt_tokens_total",
                 "tkcc_generation_tokens_total", "tkcc_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
                 "tkcc_e2e_request_latency_seconds_count", "tkcc_decode_step_seconds_sum",
                 'tkcc_active_forward_pass{candidate_id="', "tkcc_promotions_total", "tkcc_rollbacks_total"):
        assert name in text, name
    ok = [ln for ln in text.splitlines() if ln.startswith('tkcc_requests_total{endpoint="completions",status="ok"}')]
    assert ok and int(ok[0].split()[-1]) >= 1


def test_serving_log_reads_back(server):
    log = server.service.log
    tr = traffic.read_trace(log.path)
    assert tr.format == "serving_log" and len(tr.requests) == log.count
    recs = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert all(r["ttft_s"] >= 0 and r["finish_s"] >= r["first_token_s"] >= r["arrival_s"] for r in recs)
    assert all(r["output_len"] >= 1 and r["forward_passes"] for r in recs)


def test_promotion_under_load_fails_nothing(server, tmp_path):
    svc = server.service
    trace = traffic.cap(traffic.read_trace(traffic.DEFAULT_TRACE, limit=48), max_prompt=120, max_output=24)
    failures_before = svc.metrics.failures
    reports = []
    load = threading.Thread(target=lambda: reports.append(replay.replay(server.url, trace, speed=40)))
    load.start()

    def busy():  # swap only while requests are decoding, so some are in flight across it
        deadline = time.time() + 30
        while svc.scheduler.counts()[0] < 2 and time.time() < deadline:
            time.sleep(0.002)
    busy()
    promoted = svc.promote(DELEGATE, name="delegate")
    assert promoted["ok"] and svc.active == promoted["candidate_id"] and promoted["previous"] == "reference"
    time.sleep(0.2)
    busy()
    back = svc.rollback("reference", reason="test")
    assert back["ok"] and svc.active == "reference"
    busy()
    again = svc.promote(DELEGATE, name="delegate-2")
    load.join(timeout=120)
    rep = reports[0]
    assert rep["failed"] == 0 and rep["ok"] == len(trace.requests), rep
    assert svc.metrics.failures == failures_before
    recs = svc.log.window(len(trace.requests))
    assert len({p for r in recs for p in r["forward_passes"]}) >= 2  # requests really were served across the swaps
    assert any(len(r["forward_passes"]) > 1 for r in recs)  # and some were in flight during one: continued
    kinds = [e["kind"] for e in svc.ledger.events()]
    assert "promoted" in kinds and "rolled_back" in kinds
    assert svc.ledger.candidate(again["candidate_id"])["ok"]
    svc.rollback("reference", reason="test end")


def test_a_pass_that_raises_is_rolled_back_and_its_requests_finish(server):
    svc = server.service
    r = svc.promote(LATE_FAILURE, name="late-failure")
    assert r["ok"], r
    resp = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "a " * 30, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 20
    assert svc.active == "reference"
    ev = [e for e in svc.ledger.events("rolled_back") if e["candidate_id"] == r["candidate_id"]]
    assert ev and "late failure" in ev[0]["data"]["error"]


def test_moe_serving_logs_expert_routing(tmp_path):
    svc = Service(EngineConfig(model="mixtral-8x7b-v0.1", shrink=True, device="cpu", max_batch=4),
                  ServeConfig(home=str(tmp_path), port=0))
    srv = ServingServer(svc).start()
    try:
        with ThreadPoolExecutor(3) as ex:
            rs = list(ex.map(lambda i: httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "prompt": f"Prompt {i} about sparse experts.", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}), range(3)))
        assert all(r.status_code == 200 for r in rs)
        m = svc.engine.model
        recs = [json.loads(x) for x in svc.log.path.read_text().splitlines()]
        for rec in recs:
            assert len(rec["experts"]) == m.num_experts
            # eager path: every prompt token and every fed-back output token, every layer, top_k each
            tokens = rec["prompt_len"] + rec["output_len"] - 1
            assert sum(rec["experts"]) == tokens * m.num_layers * m.num_experts_per_tok
        assert "tkcc_experts_active_per_layer_count" in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def test_cli_serve_and_replay(tmp_path):
    ready = tmp_path / "ready.json"
    env = os.environ | {"TKCC_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "tkcc_mcp.cli", "serve", "--model", "llama-3.2-1b", "--shrink",
                             "--device", "cpu", "--port", "0", "--home", str(tmp_path), "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline
            time.sleep(0.1)
        url = json.loads(ready.read_text())["url"]
        assert httpx.get(url + "/health").json()["ok"]
        r = subprocess.run([sys.executable, "-m", "tkcc_mcp.cli", "replay", str(traffic.DEFAULT_TRACE), "--url", url,
                            "--limit", "6", "--speed", "100", "--max-prompt", "64", "--max-output", "4"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        rep = json.loads(r.stdout.strip().splitlines()[-1])
        assert rep["ok"] == 6 and rep["failed"] == 0 and rep["prompt_token_mismatches"] == 0
        assert rep["ttft_ms_p50"] > 0 and rep["throughput_tok_s"] > 0
        assert "TTFT" in r.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(traffic.read_trace(tmp_path / "serving.jsonl").requests) == 6
