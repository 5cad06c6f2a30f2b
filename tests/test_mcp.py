"""`tkcc mcp` through real MCP clients (stdio and streamable HTTP) against a real engine.

One engine per module (`tkcc engine start` in a subprocess, short timeouts so hangs cost
seconds); each test starts its own `tkcc mcp` processes. The ledger is read directly to
check that every call was recorded with the right agent.
"""
from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from engine_server.client import EngineClient
from engine_server.ledger import Ledger
from tkcc_mcp import launch

ROOT = Path(__file__).resolve().parent.parent
TKCC = [sys.executable, "-m", "tkcc_mcp.cli"]  # the `tkcc` console script, on this interpreter
CALL_TIMEOUT_S = 5  # the engine's in-process deadline: a pure-Python hang costs this much
GRACE_S = 3  # then the supervisor kills the worker (a hang the deadline cannot end)
# One intra-op thread: on a shared 2-core machine torch's spinning OpenMP threads slow a
# 0.5 s measurement to tens of seconds, past the timeouts above.
ENGINE_ENV = {"OMP_NUM_THREADS": "1"}
FIVE = {"read_engine_source", "submit_forward_pass", "measure_fast", "measure_full", "check_bit_exact"}
EXTRAS = {"leaderboard", "candidate_source", "traffic_profile"}

REF = (ROOT / "engine_server/models/llama.py").read_text()  # what the engine runs as its reference
SNAP_REF = (ROOT / "source_snapshots/engine_server/models/llama.py").read_text()  # what agents read
PERTURBED = ("import engine_server.models.llama as _ref\n"
             "def forward(state, batch):\n    return _ref.forward(state, batch) + 1e-6\n")
RAISES = "def forward(state, batch):\n    raise RuntimeError('boom at warm-up')\n"
HANGS = "def forward(state, batch):\n    while True:\n        pass\n"
STUCK = ("import signal\n"  # SIGALRM blocked: the engine's own deadline never fires
         "def forward(state, batch):\n    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
         "    while True:\n        pass\n")
EXITS = ("import os\nimport engine_server.models.llama as _ref\n_calls = [0]\n\n"
         "def forward(state, batch):\n    _calls[0] += 1\n"
         "    if _calls[0] > 2:  # the install's warm-up makes two calls: this dies while measured\n"
         "        os._exit(3)\n    return _ref.forward(state, batch)\n")


@dataclass
class Engine:
    home: Path
    url: str
    token_file: str

    @property
    def args(self) -> list[str]:
        return ["--engine", self.url, "--token-file", self.token_file]

    def ledger(self) -> Ledger:
        return Ledger(self.home / "ledger.db")

    def info(self) -> dict:
        return EngineClient.from_url(self.url, self.token_file, agent_id="test").call("info")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    home = tmp_path_factory.mktemp("mcp-engine")
    proc, info = launch.start_engine(home, "llama-3.2-1b", shrink=True, device="cpu", timeout_s=180, env=ENGINE_ENV,
                                     extra_args=["--call-timeout-s", str(CALL_TIMEOUT_S),
                                                 "--worker-grace-s", str(GRACE_S)])
    yield Engine(home, info["url"], info["token_file"])
    launch.stop_engine(proc.pid)


@asynccontextmanager
async def session(*args: str, errlog: Path, env: dict | None = None):
    """A `tkcc mcp ...` process over stdio and an initialised client session to it."""
    params = StdioServerParameters(command=TKCC[0], args=[*TKCC[1:], "mcp", *args],
                                   env={"TKCC_LOG_LEVEL": "WARNING", **(env or {})})
    with open(errlog, "a") as err:
        async with stdio_client(params, errlog=err) as (r, w), ClientSession(r, w, read_timeout_seconds=120) as s:
            await s.initialize()
            yield s


async def call(s: ClientSession, tool: str, **args) -> dict:
    r = await s.call_tool(tool, args)
    assert not r.is_error, r.content
    return r.structured_content


async def tool_error(s: ClientSession, tool: str, **args) -> str:
    r = await s.call_tool(tool, args)
    assert r.is_error, r.structured_content
    return r.content[0].text


def numbered_to_source(text: str) -> str:
    return "\n".join(line[7:] for line in text.splitlines()) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- stdio --------------------------------------------------------------------------------

def test_tools_are_listed_and_source_is_read_only_inside_the_snapshot(engine, tmp_path):
    async def go():
        async with session(*engine.args, "--agent-id", "reader", errlog=tmp_path / "mcp.err") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert FIVE | EXTRAS == set(tools)
            assert all(len(t.description) > 80 and t.output_schema for t in tools.values())
            assert "candidate_id" in tools["check_bit_exact"].input_schema["properties"]

            listing = await s.call_tool("read_engine_source", {})
            ref = listing.structured_content["reference_forward"]
            assert ref == "engine_server/models/llama.py"
            assert ref in {f["path"] for f in listing.structured_content["files"]}
            assert json.loads(listing.content[0].text) == listing.structured_content  # the same, as text

            whole = await call(s, "read_engine_source", path=ref)
            assert whole["total_lines"] == len(SNAP_REF.splitlines()) and not whole["truncated"]
            assert numbered_to_source(whole["text"]) == SNAP_REF
            part = await call(s, "read_engine_source", path=ref, start_line=3, end_line=5)
            assert [ln.split()[0] for ln in part["text"].splitlines()] == ["3", "4", "5"]

            for bad, why in [("../pyproject.toml", "may not contain '..'"),
                             ("engine_server/../../pyproject.toml", "may not contain '..'"),
                             ("/etc/passwd", "relative to the snapshot"),
                             (str(ROOT / "pyproject.toml"), "relative to the snapshot")]:
                assert why in await tool_error(s, "read_engine_source", path=bad)
            assert "no file" in await tool_error(s, "read_engine_source", path="nope.py")

            prof = await call(s, "traffic_profile")
            assert prof["fast_layers"] and prof["fast_shapes"] and prof["profile"]["requests"] > 0
            assert "no candidate" in await tool_error(s, "candidate_source", candidate_id="c9999")
            # an unknown candidate is the caller's mistake in every tool that takes one
            for tool in ("measure_fast", "measure_full", "check_bit_exact"):
                assert "c9999" in await tool_error(s, tool, candidate_id="c9999")
            assert "parent 'c9999'" in await tool_error(s, "submit_forward_pass", source="x = 1\n", parent="c9999")
            assert "past the end" in await tool_error(s, "read_engine_source", path=ref, start_line=10 ** 6)
            assert "not a range" in await tool_error(s, "read_engine_source", path=ref, start_line=10, end_line=3)
            # an argument no tool takes (a misspelt `mode`) is refused by name, never ignored
            assert all(t.input_schema.get("additionalProperties") is False for t in tools.values())
            why = await tool_error(s, "check_bit_exact", candidate_id="c9999", mod="tolerance")
            assert "mod" in why and "Extra inputs are not permitted" in why
            return len(tools)

    anyio.run(go)
    # every tool call is in the ledger under this agent, the refused ones included
    methods = collections.Counter(c["method"] for c in engine.ledger().calls(agent_id="reader"))
    assert methods == {"read_engine_source": 10, "traffic_profile": 1, "candidate_source": 1, "measure_fast": 1,
                       "measure_full": 1, "check_bit_exact": 1, "submit_forward_pass": 1}


def test_reference_is_exact_and_a_perturbed_copy_is_not(engine, tmp_path):
    async def go():
        async with session(*engine.args, "--agent-id", "exactness", errlog=tmp_path / "mcp.err") as s:
            sub = await call(s, "submit_forward_pass", source=REF, name="ref-copy")
            assert sub["ok"] and sub["stage"] == "ready" and sub["error"] is None
            cid = sub["candidate_id"]
            ex = await call(s, "check_bit_exact", candidate_id=cid)
            assert ex["exact"] and ex["tokens_equal"] and ex["kv_equal"] and ex["max_abs_diff"] == 0
            fast = await call(s, "measure_fast", candidate_id=cid)
            assert fast["ok"] and fast["valid"] and fast["outputs_match"] == "bitwise", fast["error"]
            lo, hi = fast["speedup_ci95"]
            # the same code: no speedup (its interval holds 1, or a host's noise moved it by little)
            assert lo <= fast["speedup"] <= hi and (lo <= 1.0 <= hi or abs(fast["speedup"] - 1) < 0.1), fast
            full = await call(s, "measure_full", candidate_id=cid)
            assert full["ok"] and full["tier"] == "full" and full["tokens_match"] == 1.0, full["error"]

            bad = await call(s, "submit_forward_pass", source=PERTURBED, name="perturbed", parent=cid)
            assert bad["ok"]
            ex2 = await call(s, "check_bit_exact", candidate_id=bad["candidate_id"])
            assert ex2["ok"] and not ex2["exact"]
            assert ex2["first_mismatch"]["phase"] and 0 < ex2["max_abs_diff"] < 1e-3
            tol = await call(s, "check_bit_exact", candidate_id=bad["candidate_id"], mode="tolerance")
            assert tol["close"] is True and tol["exact"] is False
            nan = await call(s, "submit_forward_pass", name="nan",
                             source="from engine_server.models import llama as ref\n\n"
                                    "def forward(state, batch):\n    return ref.forward(state, batch) * float('nan')\n")
            ex3 = await call(s, "check_bit_exact", candidate_id=nan["candidate_id"])  # a result, not a 500
            assert ex3["ok"] and not ex3["exact"] and ex3["max_abs_diff"] == "nan", ex3  # JSON has no NaN

            board = await call(s, "leaderboard", tier="fast", limit=50)
            row = next(r for r in board["rows"] if r["candidate_id"] == cid)
            assert row["exact"] is True and row["agent_id"] == "exactness" and row["name"] == "ref-copy"
            src = await s.call_tool("candidate_source", {"candidate_id": bad["candidate_id"]})
            assert src.structured_content["source"] == PERTURBED and src.structured_content["parent"] == cid
            return cid, bad["candidate_id"]

    cid, bad = anyio.run(go)
    led = engine.ledger()
    assert [c["method"] for c in led.calls(candidate_id=cid)] == [
        "submit_forward_pass", "check_bit_exact", "measure_fast", "measure_full"]
    assert [c["method"] for c in led.calls(candidate_id=bad)] == [
        "submit_forward_pass", "check_bit_exact", "check_bit_exact", "candidate_source"]
    assert all(c["finished_at"] and c["agent_id"] == "exactness" for c in led.calls(agent_id="exactness"))


@pytest.mark.timeout(240)
def test_failing_candidates_are_results_and_the_worker_restarts_only_when_it_dies(engine, tmp_path):
    before = engine.info()
    steps = []  # (what, worker pid after it)

    async def go():
        async with session(*engine.args, "--agent-id", "breaker", errlog=tmp_path / "mcp.err") as s:
            good = await call(s, "submit_forward_pass", source=REF, name="installed-before")
            assert good["ok"]

            r = await call(s, "submit_forward_pass", source=RAISES, name="raises")
            assert not r["ok"] and r["error"]["stage"] == "warmup" and r["error"]["type"] == "RuntimeError"
            assert "boom at warm-up" in r["error"]["message"] and "<candidate" in r["error"]["traceback"]
            steps.append(("raises", engine.info()["worker_pid"]))

            t0 = time.monotonic()
            r = await call(s, "submit_forward_pass", source=HANGS, name="hangs")
            assert not r["ok"] and r["error"]["type"] == "TimeoutError", r["error"]
            assert time.monotonic() - t0 >= CALL_TIMEOUT_S  # ended by the engine's own deadline (no restart:
            # the worker pid is checked below)
            steps.append(("hangs", engine.info()["worker_pid"]))

            progress = []

            async def on_progress(done, total, message):
                progress.append(message)

            r = await s.call_tool("submit_forward_pass", {"source": STUCK, "name": "stuck"},
                                  progress_callback=on_progress)
            r = r.structured_content  # a result, not a tool error
            assert not r["ok"] and r["error"]["stage"] == "timeout", r["error"]
            assert progress and "submit_forward_pass: running for" in progress[0]  # long calls say so
            assert "killed" in r["error"]["message"] and "restarted" in r["error"]["message"]
            steps.append(("stuck", engine.info()["worker_pid"]))

            ex = await call(s, "submit_forward_pass", source=EXITS, name="exits")
            assert ex["ok"], ex["error"]
            m = await call(s, "measure_fast", candidate_id=ex["candidate_id"])
            assert not m["ok"] and m["error"]["stage"] == "worker" and m["error"]["type"] == "WorkerDied"
            assert "exit code 3" in m["error"]["message"] and "ready for the next call" in m["error"]["message"]
            steps.append(("exits", engine.info()["worker_pid"]))

            # the engine still works: a new candidate, and one installed before the restarts
            # (reinstalled from the ledger by the new worker)
            new = await call(s, "submit_forward_pass", source=REF, name="after")
            assert new["ok"]
            for cid in (new["candidate_id"], good["candidate_id"]):
                m = await call(s, "measure_fast", candidate_id=cid)
                assert m["ok"] and m["valid"], m["error"]
            return good["candidate_id"], ex["candidate_id"]

    good, exits = anyio.run(go)
    after = engine.info()
    pids = [before["worker_pid"]] + [p for _, p in steps]
    # raising and a hang the deadline ends cost nothing; the stuck and the dying one a restart each
    assert pids[1] == pids[2] == pids[0] and len({pids[2], pids[3], pids[4]}) == 3
    assert after["restarts"] == before["restarts"] + 2
    assert after["engine"]["weights_loaded"] == 1  # loaded once per worker process, never per candidate
    led = engine.ledger()
    restarts = led.events(kind="worker_restart")[-2:]
    assert [e["data"]["reason"] for e in restarts] == ["timeout", "died"]
    assert restarts[1]["candidate_id"] == exits
    assert len(led.events(kind="worker_start")) == 1
    assert any(e["candidate_id"] == good for e in led.events(kind="reinstall"))
    calls = led.calls(agent_id="breaker")
    assert len(calls) == 9 and all(c["finished_at"] for c in calls)  # every tool call, recorded
    names = {c["name"]: c for c in led.candidates(agent_id="breaker")}
    assert set(names) == {"installed-before", "raises", "hangs", "stuck", "exits", "after"}
    assert [names[n]["ok"] for n in ("raises", "hangs", "stuck")] == [False] * 3


@pytest.mark.timeout(240)
def test_eight_agents_at_once(engine, tmp_path):
    results: dict[str, list] = {}

    async def agent(n: int):
        aid = f"a{n}"
        async with session(*engine.args, "--agent-id", aid, errlog=tmp_path / f"{aid}.err") as s:
            mine = []
            for k in range(2):
                src = f"# agent {aid}, variant {k}\n{REF}"
                sub = await call(s, "submit_forward_pass", source=src, name=f"{aid}-v{k}")
                assert sub["ok"], sub["error"]
                m = await call(s, "measure_fast", candidate_id=sub["candidate_id"])
                assert m["ok"], m["error"]
                mine.append((sub["candidate_id"], m["candidate_id"], src))
            results[aid] = mine

    async def go():
        async with anyio.create_task_group() as tg:
            for n in range(8):
                tg.start_soon(agent, n)

    anyio.run(go)
    assert len(results) == 8
    ids = [cid for mine in results.values() for cid, _, _ in mine]
    assert len(ids) == len(set(ids)) == 16
    led = engine.ledger()
    for aid, mine in results.items():
        assert all(cid == measured for cid, measured, _ in mine)  # each result is its own
        rows = {c["id"]: c for c in led.candidates(agent_id=aid, with_source=True)}
        assert set(rows) == {cid for cid, _, _ in mine}
        for k, (cid, _, src) in enumerate(mine):
            assert rows[cid]["source"] == src and rows[cid]["name"] == f"{aid}-v{k}"
        calls = led.calls(agent_id=aid)
        assert sorted((c["method"], c["candidate_id"]) for c in calls) == sorted(
            [("measure_fast", cid) for cid, _, _ in mine] + [("submit_forward_pass", cid) for cid, _, _ in mine])
        assert all(c["finished_at"] and c["ok"] for c in calls)


def test_unreachable_engine_is_a_tool_error(tmp_path):
    token = tmp_path / "engine.token"
    token.write_text("not-a-real-token\n")

    async def go():
        args = ["--engine", f"http://127.0.0.1:{free_port()}", "--token-file", str(token)]
        async with session(*args, errlog=tmp_path / "mcp.err") as s:
            assert len((await s.list_tools()).tools) == 8  # listing needs no engine
            msg = await tool_error(s, "measure_fast", candidate_id="c0001")
            assert "unreachable" in msg and "measure_fast" in msg

    anyio.run(go)


# ---- streamable HTTP ----------------------------------------------------------------------

def test_streamable_http_on_loopback(engine, tmp_path):
    port = free_port()
    err = open(tmp_path / "mcp-http.err", "w")
    proc = subprocess.Popen([*TKCC, "mcp", *engine.args, "--http", str(port), "--agent-id", "http-1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "mcp-http.err").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)

        async def go():
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (r, w), \
                    ClientSession(r, w, read_timeout_seconds=60) as s:
                await s.initialize()
                assert FIVE | EXTRAS == {t.name for t in (await s.list_tools()).tools}
                listing = await call(s, "read_engine_source")
                text = await call(s, "read_engine_source", path=listing["reference_forward"])
                assert numbered_to_source(text["text"]) == SNAP_REF

        anyio.run(go)
        # the MCP endpoint answers on loopback only, and only for loopback Host headers
        r = httpx.post(f"http://127.0.0.1:{port}/mcp", headers={"Host": "evil.example"}, json={})
        assert r.status_code in (400, 421)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        err.close()
    assert [c["method"] for c in engine.ledger().calls(agent_id="http-1")] == ["read_engine_source"] * 2

    refused = subprocess.run([*TKCC, "mcp", *engine.args, "--http", str(port), "--host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "loopback only" in refused.stderr and refused.stdout == ""


# ---- starting an engine -------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_servers_started_together_start_one_engine_and_later_ones_attach(tmp_path):
    home = tmp_path / "home"
    env = {"TKCC_HOME": str(home), **ENGINE_ENV}  # the server passes its environment to the engine
    auto = ["--model", "llama-3.2-1b", "--shrink", "--device", "cpu"]
    ids: dict[str, str] = {}
    home.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a stale record left by an engine that died: it must not stop a new start
    (home / "engine.json").write_text(json.dumps({"url": f"http://127.0.0.1:{free_port()}", "pid": dead.pid,
                                                  "token_file": str(home / "engine.token")}))

    async def agent(aid: str):
        async with session(*auto, "--agent-id", aid, env=env, errlog=tmp_path / f"{aid}.err") as s:
            listing = await call(s, "read_engine_source")  # waits for the engine being started
            assert listing["reference_forward"] == "engine_server/models/llama.py"
            ids[aid] = (await call(s, "submit_forward_pass", source=REF, name=aid))["candidate_id"]

    async def together():
        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(agent, f"auto-{n}")

    try:
        anyio.run(together)
        first = json.loads((home / "engine.json").read_text())
        anyio.run(agent, "late")  # a server started later attaches to the running engine
        assert json.loads((home / "engine.json").read_text())["pid"] == first["pid"]
        led = Ledger(home / "ledger.db")
        assert len(led.events(kind="worker_start")) == 1
        assert (home / "engine.log").read_text().count("engine start --model") == 1
        assert {c["agent_id"]: c["id"] for c in led.candidates()} == ids and len(set(ids.values())) == 4
    finally:
        pid = json.loads((home / "engine.json").read_text())["pid"] if (home / "engine.json").exists() else None
        if pid not in (None, dead.pid):
            launch.stop_engine(pid)


def test_defaults_for_a_started_engine():
    assert launch.default_shrink("llama-3.2-1b", "cpu") and not launch.default_shrink("llama-3.2-1b", "cuda")
    assert not launch.default_shrink(str(ROOT), "cpu")  # a model directory: real weights, not shrunk
    assert launch.default_device() in ("cpu", "cuda")
