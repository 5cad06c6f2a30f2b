"""`tkcc replay TRACE --url URL`: drive any OpenAI-compatible endpoint with a trace's arrivals
and lengths, and report latency and throughput.

    tkcc replay engine_server/data/traces/azure_llm_2023_code.csv --url http://127.0.0.1:8000 \\
        --speed 10 --limit 200

Contract:
* Requests are sent at `arrival_s / speed` after the start (open loop: a slow server does not
  slow the arrivals), to `POST {url}/v1/completions` with `stream: true`, `temperature: 0`,
  `max_tokens` = the trace's output length and `ignore_eos: true` (vLLM's and tkcc's
  extension; `--no-ignore-eos` leaves it out for servers that refuse unknown fields).
* The prompt is real text (the engine's prompt corpus) cut to exactly the trace's prompt
  length under a tokenizer: the model directory's (`--tokenizer DIR`) or tkcc's fallback,
  which is what `tkcc serve` uses for a model without a tokenizer, so the counts are exact for
  our server (the reply's `usage.prompt_tokens` is checked; mismatches are counted).
* Lengths are capped to `--max-prompt`/`--max-output` and to the server's context
  (`max_model_len` from `/v1/models` when it says); how many were cut is reported.
* A request failed when the HTTP status is not 200, the connection or the timeout fails, the
  stream carries an error, or it ends without `data: [DONE]`. Failures are counted, never
  raised. Latency: TTFT (send to first token), time per output token after the first,
  end-to-end; throughput: output tokens / wall time from the first send to the last reply.
* Prints a card, then one JSON line; exit status 1 when any request failed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine_server import traffic


@dataclass
class Planned:
    arrival_s: float
    prompt: str
    prompt_len: int
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    expected_prompt: int = 0
    max_tokens: int = 0
    sent_s: float = 0.0
    done_s: float = 0.0


def prompt_text(n: int, tok: traffic.Tokenizer, prompts: list[str], index: int) -> str:
    """Real text with exactly `n` tokens under `tok` when the tokenizer allows it (the shortest
    cut of the corpus, from prompt `index` on, with at least `n` tokens)."""
    text, i = "", index
    count = lambda s: len(tok._encode(s))  # noqa: E731 - the raw encoder: the cached one would keep every cut
    while count(text) < n:
        text += ("\n" if text else "") + prompts[i % len(prompts)]
        i += 1
        if i - index > 10 * len(prompts) + n:
            raise ValueError("the prompt corpus encodes to too few tokens")
    lo, hi = 0, len(text)  # the smallest cut with >= n tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if count(text[:mid]) >= n:
            hi = mid
        else:
            lo = mid + 1
    return text[:lo]


def plan(trace: traffic.Trace, tok: traffic.Tokenizer, prompts: list[str], max_prompt: int | None,
         max_output: int | None, max_len: int | None) -> tuple[list[Planned], dict]:
    out, cut = [], {"prompts_clipped": 0, "outputs_clipped": 0}
    for i, r in enumerate(trace.requests):
        p = max(1, min(r.prompt_len, max_prompt or r.prompt_len, (max_len - 1) if max_len else r.prompt_len))
        o = max(1, min(r.output_len, max_output or r.output_len, (max_len - p) if max_len else r.output_len))
        cut["prompts_clipped"] += p != r.prompt_len
        cut["outputs_clipped"] += o != max(1, r.output_len)
        out.append(Planned(r.arrival_s, prompt_text(p, tok, prompts, i), p, o))
    return out, cut


async def _one(client: httpx.AsyncClient, url: str, body: dict, p: Planned, t_start: float,
               speed: float, stop: threading.Event | None) -> Outcome | None:
    delay = t_start + p.arrival_s / speed - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if stop is not None and stop.is_set():
        return None
    body = body | {"prompt": p.prompt, "max_tokens": p.max_tokens}
    o = Outcome(ok=False, expected_prompt=p.prompt_len, max_tokens=p.max_tokens)
    o.sent_s = t0 = time.perf_counter()
    times, done = [], False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                o.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return o
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    o.error = f"stream error: {obj['error']}"
                    return o
                if obj.get("usage"):
                    o.prompt_tokens = obj["usage"].get("prompt_tokens")
                    o.tokens = obj["usage"].get("completion_tokens") or o.tokens
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        times.append(time.perf_counter())
    except (httpx.HTTPError, ValueError, OSError) as e:
        o.error = f"{type(e).__name__}: {e}"[:300]
        return o
    finally:
        o.done_s = time.perf_counter()
    if not done:
        o.error = "the stream ended without [DONE]"
        return o
    o.ok, o.e2e_s = True, o.done_s - t0
    o.tokens = o.tokens or len(times)
    if times:
        o.ttft_s = times[0] - t0
        if len(times) > 1:
            o.tpot_s = (times[-1] - times[0]) / (len(times) - 1)
    return o


async def areplay(url: str, planned: list[Planned], model: str | None = None, speed: float = 1.0,
                  timeout_s: float = 600.0, ignore_eos: bool = True, api_key: str | None = None,
                  stop: threading.Event | None = None) -> list[Outcome]:
    """Send every planned request at its arrival; `stop` (set from another thread) sends no more."""
    url = url.rstrip("/")
    body = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        t_start = time.perf_counter()
        outs = await asyncio.gather(*(_one(client, url, body, p, t_start, speed, stop) for p in planned))
    return [o for o in outs if o is not None]


def server_model(url: str, api_key: str | None = None) -> tuple[str | None, int | None]:
    """(model id, max_model_len) from GET /v1/models, or (None, None)."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        d = r.json()["data"][0]
        return d.get("id"), d.get("max_model_len")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None, None


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    pos = p * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def summarise(outs: list[Outcome]) -> dict:
    ok = [o for o in outs if o.ok]
    ms = lambda xs, p: None if _q(xs, p) is None else round(_q(xs, p) * 1e3, 3)  # noqa: E731
    ttft, tpot, e2e = ([o.ttft_s for o in ok if o.ttft_s is not None], [o.tpot_s for o in ok if o.tpot_s is not None],
                       [o.e2e_s for o in ok])
    wall = (max(o.done_s for o in outs) - min(o.sent_s for o in outs)) if outs else 0.0
    tokens = sum(o.tokens for o in ok)
    errors: dict[str, int] = {}
    for o in outs:
        if not o.ok:
            errors[o.error or "?"] = errors.get(o.error or "?", 0) + 1
    return {"requests": len(outs), "ok": len(ok), "failed": len(outs) - len(ok),
            "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
            "ttft_ms_p50": ms(ttft, .5), "ttft_ms_p90": ms(ttft, .9), "ttft_ms_p99": ms(ttft, .99),
            "tpot_ms_p50": ms(tpot, .5), "tpot_ms_p90": ms(tpot, .9),
            "e2e_ms_p50": ms(e2e, .5), "e2e_ms_p90": ms(e2e, .9),
            "output_tokens": tokens, "wall_s": round(wall, 3),
            "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
            "prompt_token_mismatches": sum(o.prompt_tokens is not None and o.prompt_tokens != o.expected_prompt
                                           for o in ok),
            "short_outputs": sum(o.tokens < o.max_tokens for o in ok)}


def replay(url: str, trace: traffic.Trace, speed: float = 1.0, model: str | None = None,
           max_prompt: int | None = None, max_output: int | None = None, tokenizer: str | None = None,
           timeout_s: float = 600.0, ignore_eos: bool = True, api_key: str | None = None,
           stop: threading.Event | None = None) -> dict:
    """Replay `trace` against `url`; returns the report (see `summarise`) with what was sent."""
    served, max_len = server_model(url, api_key)
    tok = traffic.load_tokenizer(tokenizer, 1 << 30)  # only counts matter here, not the ids
    planned, cut = plan(trace, tok, traffic.load_prompts(), max_prompt, max_output, max_len)
    outs = asyncio.run(areplay(url, planned, model or served, speed, timeout_s, ignore_eos, api_key, stop))
    return {"url": url, "trace": trace.source, "format": trace.format, "model": model or served, "speed": speed,
            "max_model_len": max_len, "tokenizer": tok.name, **cut, **summarise(outs)}


def card(rep: dict) -> str:
    f = lambda v, u="": "-" if v is None else f"{v:,.1f}{u}"  # noqa: E731
    return "\n".join([
        f"replay of {rep['trace']} ({rep['format']}) at {rep['speed']:g}x against {rep['url']} (model {rep['model']})",
        f"  requests     {rep['requests']} sent, {rep['ok']} ok, {rep['failed']} failed"
        + (f"  {rep['errors']}" if rep["errors"] else ""),
        f"  TTFT         p50 {f(rep['ttft_ms_p50'], ' ms')}  p90 {f(rep['ttft_ms_p90'], ' ms')}  "
        f"p99 {f(rep['ttft_ms_p99'], ' ms')}",
        f"  per token    p50 {f(rep['tpot_ms_p50'], ' ms')}  p90 {f(rep['tpot_ms_p90'], ' ms')}",
        f"  end to end   p50 {f(rep['e2e_ms_p50'], ' ms')}  p90 {f(rep['e2e_ms_p90'], ' ms')}",
        f"  throughput   {f(rep['throughput_tok_s'], ' tok/s')}, {f(rep['requests_per_s'], ' req/s')} "
        f"over {rep['wall_s']:.1f} s ({rep['output_tokens']} output tokens)",
        f"  lengths      {rep['prompts_clipped']} prompts and {rep['outputs_clipped']} outputs capped; "
        f"{rep['prompt_token_mismatches']} prompt-length mismatches; {rep['short_outputs']} ended early"])


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="drive an OpenAI-compatible endpoint with a trace; latency and throughput",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a trace file (Azure CSV, Mooncake JSONL, BurstGPT CSV, serving log)")
    p.add_argument("--url", required=True, help="the server's base URL (without /v1)")
    p.add_argument("--speed", type=float, default=1.0, help="arrivals compressed by this factor")
    p.add_argument("--limit", type=int, default=None, help="the first N requests of the trace")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--max-prompt", type=int, default=None, help="cap on prompt tokens")
    p.add_argument("--max-output", type=int, default=None, help="cap on output tokens")
    p.add_argument("--tokenizer", default=None, help="a model directory with tokenizer.json (default: tkcc's fallback)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--ignore-eos", action="store_true", default=True, help=__import__("argparse").SUPPRESS)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that refuse unknown fields)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--out", default=None, help="also write the JSON report here")


def main(args) -> int:
    if args.speed <= 0 or (args.limit is not None and args.limit < 1):
        raise ValueError(f"--speed must be above 0 and --limit at least 1 (got {args.speed:g}, {args.limit})")
    if args.out and not Path(args.out).resolve().parent.is_dir():  # before the replay, not after it
        raise ValueError(f"--out {args.out}: its directory does not exist")
    trace = traffic.read_trace(args.trace, args.limit)
    rep = replay(args.url, trace, args.speed, args.model, args.max_prompt, args.max_output, args.tokenizer,
                 args.timeout, args.ignore_eos, args.api_key)
    print(card(rep))
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep), flush=True)
    return 1 if rep["failed"] else 0

