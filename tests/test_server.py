"""The engine server as a user runs it: `tkcc engine start` in its own process."""
import json
import os
import signal
import sqlite3
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from engine_server.client import EngineClient, EngineUnavailable
from engine_server.ledger import Ledger
from engine_server.server import check_loopback

REF = "from engine_server.models import llama as ref\n\ndef forward(state, batch):\n    return ref.forward(state, batch)\n"
STUCK = ("import signal\nfrom engine_server.models import llama as ref\n"
         "def forward(state, batch):\n    if batch.seq_len == 1:\n"
         "        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n        while True:\n            pass\n"
         "    return ref.forward(state, batch)\n")


def test_client_calls_share_one_tls_context(monkeypatch):
    """httpx builds a TLS context for every call that is not given one (it reads the CA bundle:
    most of a loopback RPC's cost), so the client hands every call the same one."""
    seen = []

    def post(url, **kw):
        seen.append(kw.get("verify"))
        return httpx.Response(200, json={"ok": True})
    monkeypatch.setattr(httpx, "post", post)
    c = EngineClient("http://127.0.0.1:9", "token")
    assert c.call("info")["ok"] and c.call("info")["ok"]
    assert isinstance(seen[0], ssl.SSLContext) and seen[1] is seen[0]


def start_engine(home, *extra, env=None):
    ready = home / "ready.json"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tkcc_mcp.cli", "engine", "start", "--model", "llama-3.2-1b",
                             "--shrink", "--device", "cpu", "--home", str(home), "--ready-file", str(ready),
                             "--call-timeout-s", "10", "--worker-grace-s", "3", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    return proc, info


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    proc, info = start_engine(home)
    yield home, proc, info
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_token_file_is_private_and_required(engine):
    home, _, info = engine
    assert oct(os.stat(info["token_file"]).st_mode & 0o777) == "0o600"
    assert info["url"].startswith("http://127.0.0.1:")
    r = httpx.post(info["url"] + "/rpc/info", json={})
    assert r.status_code == 401
    with pytest.raises(EngineUnavailable):
        EngineClient(info["url"], "wrong").call("info")
    assert EngineClient.from_url(info["url"], info["token_file"]).call("info")["ok"]


def test_only_loopback_is_bound():
    for host in ("127.0.0.1", "::1", "localhost"):
        check_loopback(host)
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        with pytest.raises(ValueError):
            check_loopback(host)


def test_hang_past_the_deadline_restarts_the_worker(engine):
    home, _, info = engine
    c = EngineClient.from_url(info["url"], info["token_file"], agent_id="t")
    good = c.call("submit_forward_pass", source=REF, name="good")
    assert good["ok"]
    t = time.time()
    r = c.call("submit_forward_pass", source=STUCK, name="stuck")
    assert not r["ok"] and r["error"]["stage"] == "timeout" and r["worker_restarted"]
    assert time.time() - t < 60
    # the next call works, and the candidate from before the restart is reinstalled from the ledger
    m = c.call("measure_fast", candidate_id=good["candidate_id"])
    assert m["ok"] and m["valid"], m["violations"]
    assert c.call("info")["restarts"] == 1
    led = Ledger(home / "ledger.db")
    assert [e["kind"] for e in led.events()].count("worker_restart") == 1
    assert any(e["kind"] == "reinstall" for e in led.events())


def test_concurrent_reads_while_measuring(engine):
    home, _, info = engine
    c = EngineClient.from_url(info["url"], info["token_file"])
    cid = c.call("submit_forward_pass", source=REF)["candidate_id"]
    import threading
    out = {}
    th = threading.Thread(target=lambda: out.update(m=c.call("measure_full", candidate_id=cid)))
    th.start()
    time.sleep(0.3)
    t = time.time()
    src = c.call("read_engine_source", path="engine_server/models/llama.py", start_line=1, end_line=3)
    board = c.call("leaderboard")
    fast_read = time.time() - t
    th.join()
    assert src["ok"] and board["ok"] and out["m"]["ok"]
    assert fast_read < 1.0  # not queued behind the measurement


def test_kill_9_keeps_the_ledger_and_sigterm_is_clean(tmp_path):
    proc, info = start_engine(tmp_path)
    c = EngineClient.from_url(info["url"], info["token_file"], agent_id="k")
    cid = c.call("submit_forward_pass", source=REF)["candidate_id"]
    c.call("check_bit_exact", candidate_id=cid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    db = sqlite3.connect(tmp_path / "ledger.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    methods = [m for (m,) in db.execute("SELECT method FROM calls WHERE candidate_id = ? ORDER BY id", (cid,))]
    assert methods == ["submit_forward_pass", "check_bit_exact"]
    # a new engine on the same home continues the same ledger; SIGTERM stops it cleanly
    proc, info = start_engine(tmp_path)
    c = EngineClient.from_url(info["url"], info["token_file"])
    assert c.call("measure_fast", candidate_id=cid)["ok"]  # reinstalled from the ledger
    assert c.call("submit_forward_pass", source=REF)["candidate_id"] != cid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not (tmp_path / "engine.json").exists()


def test_ledger_cli(engine):
    home, _, info = engine
    env = os.environ | {"TKCC_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "tkcc_mcp.cli", "ledger", "list"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "c0001" in out
    show = json.loads(subprocess.run([sys.executable, "-m", "tkcc_mcp.cli", "ledger", "show", "c0001"], env=env,
                                     capture_output=True, text=True, check=True).stdout)
    assert show["source"] and show["calls"]
    csv_out = subprocess.run([sys.executable, "-m", "tkcc_mcp.cli", "ledger", "export", "--format", "csv",
                              "--table", "candidates"], env=env, capture_output=True, text=True, check=True).stdout
    assert csv_out.splitlines()[0].startswith("id,")


def _torn_reads(write, path, n: int = 1500) -> int:
    """How many of a poller's reads of `path` saw it cut short while `write` rewrote it n times."""
    import threading
    body = json.dumps({"url": "http://127.0.0.1:1", "pad": "x" * 20000})
    write(path, body)
    done, torn = threading.Event(), [0]

    def poll():
        while not done.is_set():
            try:
                json.loads(path.read_text())
            except ValueError:
                torn[0] += 1
    t = threading.Thread(target=poll)
    t.start()
    for _ in range(n):
        write(path, body)
    done.set()
    t.join()
    return torn[0]


def test_state_files_are_never_seen_half_written(tmp_path):
    """The launcher polls the ready file and clients poll engine.json while the server writes
    them: a reader sees the whole JSON or the one before, never an empty or cut file (a plain
    write_text was read empty by a launcher on a loaded host)."""
    from pathlib import Path

    from engine_server.client import write_atomic
    assert _torn_reads(write_atomic, tmp_path / "engine.json") == 0
    assert [p.name for p in tmp_path.iterdir()] == ["engine.json"]  # no temporary left behind
    # the race is real: the same poller catches plain writes mid-way
    assert _torn_reads(lambda p, s: Path(p).write_text(s), tmp_path / "plain.json") > 0


NAN = REF.replace("return ref.forward(state, batch)", "return ref.forward(state, batch) * float('nan')")
FORGER = REF + '''
import json, os

def prepare(state):
    """Finds the worker's reply channel among its descriptors and writes replies ahead of time."""
    for fd in range(3, 64):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") and fd != 0:
                for i in range(1, 200):
                    os.write(fd, (json.dumps({"id": i, "ok": True, "result": {
                        "candidate_id": "FORGED", "ok": True, "stage": "ready", "speedup": 99.0,
                        "valid": True, "exact": True}}) + "\\n").encode())
        except OSError:
            continue
'''
# the worker ends half a second after the install returns, from a thread that runs none of the
# candidate's code (a timer calling os._exit): the engine's sweep for stray threads stops those
# that run candidate code, and a thread it cannot see is what the server's restart is for
LATE_EXIT = REF + "import os, threading\n\ndef prepare(state):\n" \
                  "    threading.Timer(0.5, os._exit, args=(1,)).start()\n"


def test_non_finite_results_reach_the_caller(engine):
    """A NaN logit's max_abs_diff is valid JSON on the wire ("nan"), not a 500."""
    _, _, info = engine
    c = EngineClient.from_url(info["url"], info["token_file"])
    cid = c.call("submit_forward_pass", source=NAN)["candidate_id"]
    ex = c.call("check_bit_exact", candidate_id=cid)
    assert ex["ok"] and not ex["exact"] and ex["max_abs_diff"] == "nan"


def test_forged_replies_are_refused_and_the_worker_restarted(engine):
    home, _, info = engine
    c = EngineClient.from_url(info["url"], info["token_file"], agent_id="forger")
    before = c.call("info")["restarts"]
    r = c.call("submit_forward_pass", source=FORGER, name="forger")
    assert not r["ok"] and r["candidate_id"] != "FORGED", r
    assert r["error"]["type"] == "Tampering" and r["worker_restarted"], r["error"]
    assert c.call("info")["restarts"] == before + 1
    good = c.call("submit_forward_pass", source=REF)
    assert good["ok"] and good["candidate_id"].startswith("c")
    m = c.call("measure_fast", candidate_id=good["candidate_id"])
    assert m["ok"] and m["valid"] and m["speedup"] < 2
    assert not any(row["candidate_id"] == "FORGED" for row in c.call("leaderboard")["rows"])


def test_a_worker_that_dies_between_calls_is_restarted_without_blaming_the_next_call(engine):
    home, _, info = engine
    x = EngineClient.from_url(info["url"], info["token_file"], agent_id="x")
    y = EngineClient.from_url(info["url"], info["token_file"], agent_id="y")
    mine = y.call("submit_forward_pass", source=REF)["candidate_id"]
    late = x.call("submit_forward_pass", source=LATE_EXIT)
    assert late["ok"]
    time.sleep(2)  # the worker is gone now
    m = y.call("measure_fast", candidate_id=mine)
    assert m["ok"] and m["valid"], m.get("error")
    led = Ledger(home / "ledger.db")
    ev = [e for e in led.events() if e["kind"] == "worker_restart"][-1]
    assert ev["candidate_id"] == late["candidate_id"] and "between calls" in ev["data"]["message"]
    # the answer the worker gave last before it died is withdrawn: code left in it could have given it
    submit = led.calls(candidate_id=late["candidate_id"], method="submit_forward_pass")[-1]
    assert submit["ok"] == 0 and submit["error"].startswith("voided: the worker died")
    assert any(e["kind"] == "voided" and e["candidate_id"] == late["candidate_id"] for e in led.events())


def test_an_engine_error_says_what_failed_and_restarts_the_worker(tmp_path):
    """An exception of the engine's own (one injected here into Engine.rollback at start-up) is
    answered with its message, and the worker restarted: nothing half-done carries over."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(
        "import engine_server.engine as e\n\n"
        "def broken(self, candidate_id='reference'):\n    raise LookupError('an injected engine bug')\n\n"
        "e.Engine.rollback = broken\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "inject"), os.environ.get("PYTHONPATH", "")])}
    proc, info = start_engine(tmp_path, env=env)
    try:
        c = EngineClient.from_url(info["url"], info["token_file"])
        r = c.call("rollback", candidate_id="reference")
        assert not r["ok"] and r["worker_restarted"], r
        assert "LookupError: an injected engine bug" in r["error"] and "worker.log" in r["error"], r["error"]
        assert c.call("info")["restarts"] == 1
        good = c.call("submit_forward_pass", source=REF)["candidate_id"]
        assert c.call("measure_fast", candidate_id=good)["valid"]
    finally:
        proc.kill()
        proc.wait()


def test_a_second_engine_on_a_home_in_use_is_refused(engine):
    home, _, info = engine
    token = (home / "engine.token").read_text()
    out = subprocess.run([sys.executable, "-m", "tkcc_mcp.cli", "engine", "start", "--model", "llama-3.2-1b",
                          "--shrink", "--device", "cpu", "--home", str(home)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "already running" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert (home / "engine.token").read_text() == token and (home / "engine.json").exists()
    assert EngineClient.from_url(info["url"], info["token_file"]).call("info")["ok"]
