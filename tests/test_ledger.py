"""Ledger: round trips, leaderboard, concurrency (threads and processes), kill -9, export."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine_server.ledger import Ledger, format_table

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.db") as led:
        yield led


def test_wal_schema_and_pragmas(ledger):
    c = sqlite3.connect(ledger.path)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert c.execute("SELECT version FROM schema_version").fetchall() == [(1,)]
    tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"candidates", "calls", "events", "counters", "schema_version"} <= tables
    c.close()
    Ledger(ledger.path).close()  # reopening keeps one schema_version row
    c = sqlite3.connect(ledger.path)
    assert c.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 1
    c.close()


def test_candidate_round_trip(ledger):
    src = "def forward(state, batch):\n    return ref.forward(state, batch)\n"
    cid = ledger.next_candidate_id()
    assert cid == "c0001"
    assert ledger.add_candidate(cid, src, name="base", agent_id="a1") == cid
    ledger.add_candidate("c0002", src + "# v2\n", name="v2", parent=cid, agent_id="a2")
    assert ledger.next_candidate_id() == "c0003"  # counter also respects ids added by hand
    got = ledger.candidate(cid)
    assert got["source"] == src and got["source_hash"] == hashlib.sha256(src.encode()).hexdigest()
    assert got["name"] == "base" and got["stage"] is None and got["ok"] is None
    ledger.update_candidate(cid, stage="captured", ok=True)
    ledger.update_candidate(cid, error="late note")  # only the given field changes
    got = ledger.candidate(cid)
    assert (got["stage"], got["ok"], got["error"]) == ("captured", True, "late note")
    assert ledger.candidate("nope") is None
    assert [c["id"] for c in ledger.candidates()] == ["c0001", "c0002"]
    assert [c["id"] for c in ledger.candidates(agent_id="a2")] == ["c0002"]
    assert "source" not in ledger.candidates()[0]
    assert ledger.candidates(with_source=True)[1]["parent"] == cid
    auto = ledger.add_candidate(None, "x = 1")
    assert auto == "c0004"


def test_calls_and_events_round_trip(ledger):
    ledger.add_candidate("c0001", "src")
    k1 = ledger.start_call("measure_fast", "c0001", "a1", params={"tier": "fast"})
    running = ledger.calls()[0]
    assert running["finished_at"] is None and running["ok"] is None and running["result"] is None
    result = {"speedup": 1.25, "ci": [1.2, 1.3], "hw": {"gpu": "H200"}, "t": Path("/x"),
              "bad": float("nan"), 3: "int key"}
    ledger.finish_call(k1, True, result)
    k2 = ledger.start_call("check_bit_exact", "c0001", "a2")
    ledger.finish_call(k2, False, error="Traceback: boom")
    ledger.start_call("read_engine_source", agent_id="a1", params={"path": "llama.py"})
    calls = ledger.calls()
    assert [c["id"] for c in calls] == [k1, k2, k2 + 1]
    c1 = calls[0]
    assert c1["ok"] is True and c1["params"] == {"tier": "fast"}
    assert c1["result"] == {"speedup": 1.25, "ci": [1.2, 1.3], "hw": {"gpu": "H200"}, "t": "/x",
                            "bad": "nan", "3": "int key"}
    assert c1["finished_at"] >= c1["started_at"]
    assert calls[1]["ok"] is False and calls[1]["error"] == "Traceback: boom"
    assert [c["id"] for c in ledger.calls(candidate_id="c0001")] == [k1, k2]
    assert [c["id"] for c in ledger.calls(agent_id="a1")] == [k1, k2 + 1]
    assert [c["id"] for c in ledger.calls(method="check_bit_exact")] == [k2]
    assert [c["id"] for c in ledger.calls(limit=2)] == [k2, k2 + 1]  # latest 2, oldest first
    e1 = ledger.record_event("worker_restart", {"cost_s": 41.5, "cause": "SIGSEGV"}, "c0001")
    ledger.record_event("promotion", {"from": "ref"}, "c0001", agent_id="a1")
    evs = ledger.events()
    assert evs[0]["id"] == e1 and evs[0]["data"] == {"cost_s": 41.5, "cause": "SIGSEGV"}
    assert [e["kind"] for e in ledger.events(kind="promotion")] == ["promotion"]
    assert ledger.events(kind="promotion")[0]["agent_id"] == "a1"


def _measure(led, cid, method, ok=True, **result):
    k = led.start_call(method, cid)
    led.finish_call(k, ok, result)


def test_leaderboard(ledger):
    for cid in ("c0001", "c0002", "c0003", "c0004"):
        ledger.add_candidate(cid, f"# {cid}", name=cid.upper())
    _measure(ledger, "c0001", "measure_fast", speedup=1.10)
    _measure(ledger, "c0001", "measure_fast", speedup=1.30)
    _measure(ledger, "c0001", "measure_fast", speedup=1.20)
    _measure(ledger, "c0002", "measure_fast", speedup=1.50)
    _measure(ledger, "c0002", "measure_fast", ok=False, speedup=9.0)  # failed: ignored
    _measure(ledger, "c0003", "measure_fast", speedup=0.90)
    _measure(ledger, "c0003", "measure_fast", speedup=float("inf"))  # non-finite: ignored
    _measure(ledger, "c0004", "measure_fast", speedup="fast")  # not a number: ignored
    _measure(ledger, "c0003", "measure_full", speedup=2.0)  # other metric
    ledger.start_call("measure_fast", "c0003")  # in flight: no result yet
    # c0001: exact, then not exact -> False; c0002: not, then exact -> True; c0003: never checked
    _measure(ledger, "c0001", "check_bit_exact", exact=True)
    _measure(ledger, "c0001", "check_bit_exact", exact=False, first_mismatch=3)
    _measure(ledger, "c0002", "check_bit_exact", exact=False)
    _measure(ledger, "c0002", "check_bit_exact", exact=True)
    ledger.start_call("check_bit_exact", "c0002")  # in flight: does not hide the verdict
    board = ledger.leaderboard()
    assert [(r["candidate_id"], r["speedup"], r["exact"]) for r in board] == [
        ("c0002", 1.5, True), ("c0001", 1.3, False), ("c0003", 0.9, None)]
    assert board[0]["name"] == "C0002" and board[1]["n_measurements"] == 3
    full = ledger.leaderboard("measure_full")
    assert [(r["candidate_id"], r["speedup"]) for r in full] == [("c0003", 2.0)]
    # a check that crashed the worker (ok=0, no result) is the latest verdict: not exact
    _measure(ledger, "c0002", "check_bit_exact", ok=False)
    assert ledger.leaderboard()[0]["exact"] is False
    text = format_table(board, ["candidate_id", "name", "speedup", "exact"])
    assert text.splitlines()[0].split() == ["candidate_id", "name", "speedup", "exact"]
    assert "c0002" in text.splitlines()[2] and "1.5" in text.splitlines()[2]


def test_threads_write_concurrently(ledger):
    n_threads, n_calls, errors, ids = 8, 20, [], []
    start = threading.Barrier(n_threads)

    def work(t):
        try:
            start.wait()
            for i in range(n_calls):
                cid = ledger.next_candidate_id()
                ids.append(cid)
                ledger.add_candidate(cid, f"# t{t} i{i}", agent_id=f"t{t}")
                k = ledger.start_call("measure_fast", cid, f"t{t}", params={"i": i})
                ledger.finish_call(k, True, {"speedup": 1 + i / 100, "t": t})
                ledger.record_event("tick", {"t": t, "i": i})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    total = n_threads * n_calls
    assert len(set(ids)) == total
    calls = ledger.calls()
    assert len(calls) == total and all(c["ok"] and c["finished_at"] for c in calls)
    for t in range(n_threads):
        got = sorted(c["params"]["i"] for c in ledger.calls(agent_id=f"t{t}"))
        assert got == list(range(n_calls))
    assert len(ledger.candidates()) == total and len(ledger.events("tick")) == total
    assert len(ledger.leaderboard()) == total


def test_processes_allocate_unique_ids(tmp_path):
    db, n_procs, per = tmp_path / "sub" / "ledger.db", 4, 25  # the DB does not exist yet
    script = textwrap.dedent("""
        import sys, time
        from engine_server.ledger import Ledger
        db, who, per, t0 = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        while time.time() < t0:
            time.sleep(0.001)
        led = Ledger(db)
        for i in range(per):
            cid = led.next_candidate_id()
            led.add_candidate(cid, f"# {who} {i}", agent_id=who)
            k = led.start_call("submit_forward_pass", cid, who)
            led.finish_call(k, True, {"candidate_id": cid})
            print(cid, flush=True)
    """)
    t0 = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", script, str(db), f"p{p}", str(per), str(t0)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for p in range(n_procs)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    printed = [line for out, _ in outs for line in out.split()]
    assert len(printed) == n_procs * per == len(set(printed))
    with Ledger(db) as led:
        cands = led.candidates()
        assert sorted(c["id"] for c in cands) == sorted(printed)
        assert sorted(c["id"] for c in cands) == [f"c{i:04d}" for i in range(1, n_procs * per + 1)]
        for p in range(n_procs):
            assert len(led.candidates(agent_id=f"p{p}")) == per
        assert len(led.calls(method="submit_forward_pass")) == n_procs * per


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_uses_its_own_connection(ledger):
    ledger.add_candidate("c0001", "parent")  # the parent's connection is open across fork
    pid = os.fork()
    if pid == 0:  # child: same Ledger object, must open a fresh connection
        code = 1
        try:
            ledger.add_candidate(ledger.next_candidate_id(), "child")
            ledger.close()  # closes only what the child opened
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [c["id"] for c in ledger.candidates()] == ["c0001", "c0002"]
    ledger.record_event("after_fork")  # the parent's connection still works
    assert len(ledger.events("after_fork")) == 1


WRITER = textwrap.dedent("""
    import sys, time
    from engine_server.ledger import Ledger
    led = Ledger(sys.argv[1])
    n, pause = int(sys.argv[2]), float(sys.argv[3])
    for i in range(n):
        cid = led.next_candidate_id()
        led.add_candidate(cid, "x" * 5000 + str(i))
        k = led.start_call("measure_fast", cid, params={"i": i})
        led.finish_call(k, True, {"speedup": 1.0 + i, "pad": "y" * 2000})
        print("done", k, cid, flush=True)
        time.sleep(pause)
    k = led.start_call("measure_full", "in-flight")  # killed before it finishes
    print("started", k, flush=True)
    time.sleep(3600)
""")


@pytest.mark.parametrize("kill_after,pause", [(5, 0.0), (40, 0.0), (40, 0.01)],
                         ids=["mid-writing", "after-burst", "idle"])
def test_kill_9_durability(tmp_path, kill_after, pause):
    db, n = tmp_path / "ledger.db", 40
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(n), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    reported = []
    try:
        while len(reported) < kill_after:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            _, k, cid = line.split()
            reported.append((int(k), cid))
        if kill_after == n:  # wait until it sits in the sleep with a call in flight
            assert proc.stdout.readline().startswith("started")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    raw = sqlite3.connect(db)  # a fresh connection recovers from the WAL left behind
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    with Ledger(db) as led:
        for k, cid in reported:
            assert led.candidate(cid)["source"].startswith("xxx")
            call = [c for c in led.calls(candidate_id=cid) if c["id"] == k][0]
            assert call["ok"] is True and call["result"]["speedup"] == 1.0 + int(cid[1:]) - 1
        if kill_after == n:
            inflight = led.calls(method="measure_full")
            assert len(inflight) == 1 and inflight[0]["finished_at"] is None
        assert led.next_candidate_id() not in {cid for _, cid in reported}  # counter survived


def test_export_json_and_csv(ledger):
    src = 'def forward(state, batch):\n    return "a,b"  # quotes, commas\n'
    ledger.add_candidate("c0001", src, name="x", agent_id="a")
    ledger.update_candidate("c0001", stage="captured", ok=True)
    k = ledger.start_call("measure_fast", "c0001", "a", params={"n": 1})
    ledger.finish_call(k, True, {"speedup": 1.5, "ci": [1.4, 1.6]})
    ledger.record_event("rollback", {"reason": "drift"}, "c0001")
    for table, n in (("candidates", 1), ("calls", 1), ("events", 1)):
        buf = io.StringIO()
        assert ledger.export("json", table, buf) == n
        rows = json.loads(buf.getvalue())
        assert len(rows) == n
        buf = io.StringIO()
        ledger.export("csv", table, buf)
        back = list(csv.DictReader(io.StringIO(buf.getvalue())))
        assert len(back) == n and set(back[0]) == set(rows[0])
    buf = io.StringIO()
    ledger.export("json", "calls", buf)
    assert json.loads(buf.getvalue())[0]["result"] == {"speedup": 1.5, "ci": [1.4, 1.6]}
    buf = io.StringIO()
    ledger.export("csv", "calls", buf)
    row = next(csv.DictReader(io.StringIO(buf.getvalue())))
    assert json.loads(row["result"])["ci"] == [1.4, 1.6] and row["method"] == "measure_fast"
    buf = io.StringIO()
    ledger.export("csv", "candidates", buf)
    assert next(csv.DictReader(io.StringIO(buf.getvalue())))["source"] == src
    buf = io.StringIO()
    ledger.export("csv", "events", buf)  # header even for filtered-out / empty content
    assert buf.getvalue().splitlines()[0] == "id,at,kind,candidate_id,agent_id,data"
    with pytest.raises(ValueError):
        ledger.export("xml", "calls", io.StringIO())
    with pytest.raises(ValueError):
        ledger.export("json", "sqlite_master", io.StringIO())


def test_format_table_truncates_and_aligns():
    rows = [{"id": "c0001", "speedup": 1.23456, "note": "n" * 100, "none": None},
            {"id": "c0002", "speedup": 12.0, "note": "multi\nline", "none": None}]
    text = format_table(rows, ["id", "speedup", "note", "none"], max_width=20)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("id")
    assert "1.235" in lines[2] and "n" * 17 + "..." in lines[2] and "n" * 21 not in text
    assert "multi line" in lines[3]
    assert lines[2].index("1.235") == lines[3].index("12") == lines[0].index("speedup")
    assert format_table([], ["a", "b"]).splitlines()[0].split() == ["a", "b"]
