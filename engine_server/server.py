"""The engine server: a supervisor in front of one worker process that owns the device.

    tkcc engine start --model M [--shrink] [--device D] [--traffic FILE] [--port P]

- HTTP+JSON on a loopback address only; `POST /rpc/<method>` with `Authorization: Bearer
  <token>`, the token read from `$TKCC_HOME/engine.token` (mode 0600). Method names are the
  tool names. `GET /health` needs no token and says only whether the engine is up.
- Calls that use the device (submit, measure, check, rollback) are serialised on one lock;
  the others (source, leaderboard, candidate source, traffic profile, info) are answered by
  the supervisor from the snapshot and the ledger, concurrently.
- Every call has a timeout. A worker that hangs past it, or dies (segfault, CUDA fault,
  os._exit, out-of-memory kill), is restarted: the call returns a clear error, the restart
  and its cost go into the ledger, and the next call works. Candidates installed before a
  restart are reinstalled from the ledger when next used. A worker that ended between calls
  is restarted before the next call, which is not blamed (the event names the last install).
- Every reply carries its call's nonce; a line without it (code in the worker writing to the
  reply channel) kills and restarts the worker, and the call says so. An exception of the
  engine's own is answered with its message and the worker restarted, so nothing half-done
  carries over.
- The ledger row of every call is written before its result is returned.
- SIGTERM (or Ctrl-C) stops the worker and removes engine.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine_server import snapshot
from engine_server.client import running_engine, state_dir, write_atomic
from engine_server.config import EngineConfig
from engine_server.ledger import Ledger, strict_json
from engine_server.log import get_logger
from engine_server.results import ErrorInfo, ExactResult, InstallResult, MeasureResult

log = get_logger("server")

LOOPBACK = ("127.0.0.1", "::1", "localhost")
DEVICE_METHODS = {"submit_forward_pass", "measure_fast", "measure_full", "check_bit_exact", "rollback"}
LOCAL_METHODS = {"read_engine_source", "leaderboard", "candidate_source", "traffic_profile", "info"}


class WorkerFailure(Exception):
    """The worker could not answer a call and was killed or has exited; `kind` says how:
    "timeout" (a hang past the call's deadline), "died" (its process ended), "tampered" (a
    protocol line nobody asked for: code in the worker writes to the reply channel) or
    "internal" (the engine's own exception, answered, after which the worker exits)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Worker:
    """A worker process and a reader thread that turns its stdout lines into a queue."""

    def __init__(self, config: EngineConfig, log_path: Path):
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.info: dict = {}
        self._id = 0

    def start(self, timeout: float = 1800.0) -> float:
        t0 = time.perf_counter()
        self.lines = queue.Queue()
        logf = open(self.log_path, "ab")
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_server.worker", json.dumps(dataclasses.asdict(self.config))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=env, start_new_session=True)
        logf.close()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        # written before any candidate code runs
        first = self._wait(0, time.monotonic() + timeout, timeout, 0.0, "start", lambda m: True)
        if not first.get("ok"):
            self.kill()
            raise RuntimeError(f"engine worker failed to start: {first.get('error')} (log: {self.log_path})")
        self.info = first["result"]
        return time.perf_counter() - t0

    @staticmethod
    def _read(proc, lines):
        for line in proc.stdout:
            try:
                lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        lines.put(None)  # EOF: the worker is gone

    def _wait(self, rid: int, deadline: float, timeout: float, grace: float, what: str, expect) -> dict:
        """The worker's next line, which must be call `rid`'s and pass `expect`; else WorkerFailure."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerFailure("timeout", f"{what} ran past its timeout of {timeout - grace:g} s"
                                               + (f" and {grace:g} s of grace" if grace else "")
                                               + "; the worker was killed")
            try:
                msg = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                code = self.proc.wait()
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise WorkerFailure("died", f"the worker died ({how}) during {what}")
            if not isinstance(msg, dict) or msg.get("id") != rid or not expect(msg):
                self.kill()
                failure = WorkerFailure("tampered", f"the worker wrote a reply nobody asked for during {what} "
                                                    f"(not this call's id and nonce): code running in the worker "
                                                    f"writes to the engine's reply channel; the worker was killed")
                failure.reply_to = msg.get("id") if isinstance(msg, dict) else None
                raise failure
            if msg.get("fatal"):  # the worker exits after this line; the restart kills what is left
                raise WorkerFailure("internal", f"the engine failed in {what}: {msg.get('error')} "
                                                f"(traceback in {self.log_path})")
            return msg

    def _send(self, msg: dict, what: str, first: bool) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            if first:  # nobody was reading before this call began: it is not to blame
                failure = WorkerFailure("died", f"the worker had stopped reading before {what} was sent")
                failure.before = True
                raise failure from None
            # later: the reader sees EOF and reports the death

    def call(self, method: str, params: dict, timeout: float, agent: str | None = None, grace: float = 0.0) -> dict:
        """One call: the request, the worker's word that it has run, then the call's nonce (fresh,
        and sent only now), then the reply carrying it."""
        self._id += 1
        rid, deadline = self._id, time.monotonic() + timeout
        self._send({"id": rid, "method": method, "params": params, "agent": agent}, method, first=True)
        self._wait(rid, deadline, timeout, grace, method, lambda m: m.get("sealed") is False and len(m) == 2)
        nonce = secrets.token_hex(16)
        self._send({"id": rid, "nonce": nonce}, method, first=False)
        return self._wait(rid, deadline, timeout, grace, method, lambda m: m.get("nonce") == nonce)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Supervisor:
    def __init__(self, config: EngineConfig, home: Path, ledger_path: Path | None = None):
        self.config = config
        self.home = home
        self.ledger = Ledger(ledger_path or home / "ledger.db")
        self.worker = Worker(config, home / "worker.log")
        self.device_lock = threading.Lock()
        self.installed: set[str] = set()  # in the worker now (a restart empties it)
        self.last_install: tuple[str, str | None] | None = None  # (candidate, agent): who ran code last
        self.last_answer: dict | None = None  # the worker's latest answer: withdrawn if shown forged
        self._calling = threading.local()  # the ledger call a thread is serving
        self.restarts = 0
        self.started_at = time.time()
        startup = self.worker.start()
        self.ledger.record_event("worker_start", {"seconds": round(startup, 3), "model": config.model,
                                                  "device": config.device})
        self.profile = self._device_call("traffic_profile", {}, 120)
        log.info("worker ready", seconds=round(startup, 2), model=self.worker.info.get("model", {}).get("name"))

    # -- dispatch ---------------------------------------------------------------------

    def timeout_for(self, method: str) -> float:
        # the worker's own deadline fires first; the grace is for hangs it cannot end
        return self.config.call_timeout_s + self.config.worker_grace_s

    def handle(self, method: str, params: dict, agent_id: str | None = None) -> dict:
        if method not in DEVICE_METHODS | LOCAL_METHODS:
            return {"ok": False, "error": f"unknown method {method!r}; methods: "
                                          f"{sorted(DEVICE_METHODS | LOCAL_METHODS)}"}
        if method == "submit_forward_pass":
            params = self._new_candidate(params, agent_id)
        cid = params.get("candidate_id")
        logged = {k: v for k, v in params.items() if k != "source"}
        call_id = self.ledger.start_call(method, cid, agent_id, logged)
        self._calling.id = call_id
        try:
            result = getattr(self, "_" + method)(agent_id=agent_id, **params)
        except TypeError as e:
            result = {"ok": False, "error": f"bad parameters for {method}: {e}"}
        except Exception as e:  # noqa: BLE001 - the call fails, its ledger row is still finished
            log.exception("call failed", method=method, candidate=cid, agent=agent_id)
            result = {"ok": False, "error": f"{method} failed in the engine server: {type(e).__name__}: {e}"}
        if isinstance(result, dict) and result.get("candidate_id") and not cid:
            cid = result["candidate_id"]
        self.ledger.finish_call(call_id, bool(result.get("ok")), result,
                                error=_error_text(result), candidate_id=cid)
        log.info("call", method=method, candidate=cid, agent=agent_id, ok=result.get("ok"))
        return result

    def _device_call(self, method: str, params: dict, timeout: float | None = None, agent: str | None = None) -> dict:
        """Run on the worker; a hang or death restarts it and raises WorkerFailure. A worker found
        gone before the call was sent is restarted and the call sent again."""
        for attempt in (0, 1):
            if self.worker.proc.poll() is not None:
                self._died_idle()
            try:
                resp = self.worker.call(method, params, timeout or self.timeout_for(method), agent,
                                        grace=0.0 if timeout else self.config.worker_grace_s)
                break
            except WorkerFailure as e:
                if getattr(e, "before", False) and attempt == 0:
                    self._died_idle()
                    continue
                if getattr(e, "reply_to", None) is not None and self.last_answer \
                        and e.reply_to == self.last_answer["worker_id"]:
                    self._void_last(f"its real reply came after the one returned ({e})")
                self._restart(e, method, params.get("candidate_id"))
                raise
        self.last_answer = {"call_id": getattr(self._calling, "id", None), "worker_id": self.worker._id,
                            "method": method, "candidate_id": params.get("candidate_id")}
        if not resp.get("ok"):
            return {"ok": False, "error": resp.get("error")}
        return resp["result"]

    def _void_last(self, reason: str) -> None:
        """Withdraw the last answer the worker gave (its ledger row no longer ok): a worker found
        forging, or dead with nothing asked of it, may have given it on a candidate's behalf."""
        last, self.last_answer = self.last_answer, None
        if last and last["call_id"] is not None:
            self.ledger.void_call(last["call_id"], reason)
            self.ledger.record_event("voided", {"call": last["call_id"], "method": last["method"], "reason": reason},
                                     candidate_id=last["candidate_id"])
            log.warning("answer withdrawn", call=last["call_id"], method=last["method"],
                        candidate=last["candidate_id"], reason=reason)

    def _died_idle(self) -> None:
        """The worker ended between calls (a thread a candidate left behind, a closed pipe): restart
        it before the next call, which is not to blame, and say which installs it had run."""
        try:
            code = self.worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it stopped reading but lingers (a thread holds its exit up)
            self.worker.kill()
            code = self.worker.proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        last = self.last_install
        failure = WorkerFailure("died", f"the worker died ({how}) between calls; the last candidate installed "
                                        f"in it was {last[0] if last else None!r} (agent {last[1] if last else None!r})")
        self._void_last(str(failure))
        self._restart(failure, "idle", last[0] if last else None)

    def _restart(self, failure: WorkerFailure, method: str, cid: str | None) -> None:
        self.worker.kill()
        suspects = sorted(self.installed)
        t0 = time.perf_counter()
        self.worker.start()
        cost = time.perf_counter() - t0
        self.restarts += 1
        self.installed.clear()
        self.last_install = None
        failure.restart_s = cost
        self.ledger.record_event("worker_restart", {"reason": failure.kind, "message": str(failure),
                                                    "method": method, "seconds": round(cost, 3),
                                                    "restarts": self.restarts, "installed": suspects},
                                 candidate_id=cid)
        log.warning("worker restarted", reason=failure.kind, method=method, candidate=cid, seconds=round(cost, 2))

    def _failed(self, model, failure: WorkerFailure, **fields) -> dict:
        stage, kind = {"timeout": ("timeout", "TimeoutError"), "tampered": ("worker", "Tampering"),
                       "internal": ("engine", "EngineError")}.get(failure.kind, ("worker", "WorkerDied"))
        err = ErrorInfo(stage=stage, type=kind,
                        message=f"{failure}; restarted in {getattr(failure, 'restart_s', 0):.1f} s "
                                f"(restart #{self.restarts}). The engine is ready for the next call.")
        out = model(ok=False, error=err, **fields).model_dump(mode="json")
        out["worker_restarted"] = True
        out["restart_s"] = round(getattr(failure, "restart_s", 0.0), 3)
        return out

    def _ensure_installed(self, cid: str) -> dict | None:
        """Reinstall a candidate the worker lost in a restart. None when it is there."""
        if self.worker.proc.poll() is not None:
            self._died_idle()
        if cid in self.installed or cid == "reference":
            return None
        row = self.ledger.candidate(cid)
        if row is None:
            return {"ok": False, "message": f"no candidate {cid!r}"}
        if not row.get("ok"):
            return {"ok": False, "message": f"candidate {cid!r} did not install ({row.get('stage')}): "
                                            f"{row.get('error')}"}
        r = self._device_call("submit_forward_pass", {"source": row["source"], "name": row.get("name"),
                                                      "parent": row.get("parent"), "candidate_id": cid})
        self.ledger.record_event("reinstall", {"ok": r.get("ok")}, candidate_id=cid)
        if r.get("ok"):
            self.installed.add(cid)
            self.last_install = (cid, row.get("agent_id"))
            return None
        return {"ok": False, "message": f"reinstall of {cid!r} failed: {_error_text(r)}"}

    # -- device methods ---------------------------------------------------------------

    def _new_candidate(self, params: dict, agent_id: str | None) -> dict:
        """Give a submission its id and ledger row before anything runs, so that even a call
        cut short by a kill names its candidate. Callers cannot choose ids."""
        params = {k: v for k, v in params.items() if k != "candidate_id"}
        source, parent = params.get("source"), params.get("parent")
        known = not parent or parent == "reference" or self.ledger.candidate(parent) is not None
        if isinstance(source, str) and source.strip() and known:
            params["candidate_id"] = self.ledger.next_candidate_id()
            self.ledger.add_candidate(params["candidate_id"], source, name=params.get("name"),
                                      parent=params.get("parent"), agent_id=agent_id)
        return params

    def _submit_forward_pass(self, source: str, name: str | None = None, parent: str | None = None,
                             agent_id: str | None = None, candidate_id: str | None = None) -> dict:
        if candidate_id is None:  # _new_candidate gives every non-empty source with a known parent an id
            if isinstance(source, str) and source.strip():
                return {"ok": False, "error": f"parent {parent!r} is not a candidate in this engine's ledger "
                                              f"(leaderboard lists them; 'reference' is the engine's own pass)"}
            return InstallResult(candidate_id="", ok=False, stage="none", error=ErrorInfo(
                stage="parse", type="ValueError", message="source is empty")).model_dump(mode="json")
        cid = candidate_id
        with self.device_lock:
            try:
                r = self._device_call("submit_forward_pass", {"source": source, "name": name, "parent": parent,
                                                              "candidate_id": cid}, agent=agent_id)
            except WorkerFailure as f:
                r = self._failed(InstallResult, f, candidate_id=cid, name=name, parent=parent, stage="none")
        if r.get("ok"):
            self.installed.add(cid)
            self.last_install = (cid, agent_id)
        self.ledger.update_candidate(cid, stage=r.get("stage"), ok=bool(r.get("ok")), error=_error_text(r))
        return r

    def _measured(self, method: str, model, candidate_id: str, extra: dict, agent_id: str | None = None,
                  **params) -> dict:
        with self.device_lock:
            try:
                missing = self._ensure_installed(candidate_id)
                if missing is not None:
                    return model(candidate_id=candidate_id, ok=False, **extra, error=ErrorInfo(
                        stage="lookup", type="KeyError", message=missing["message"])).model_dump(mode="json")
                return self._device_call(method, {"candidate_id": candidate_id, **params}, agent=agent_id)
            except WorkerFailure as f:
                return self._failed(model, f, candidate_id=candidate_id, **extra)

    def _measure_fast(self, candidate_id: str, agent_id: str | None = None) -> dict:
        return self._measured("measure_fast", MeasureResult, candidate_id, {"tier": "fast", "valid": False},
                              agent_id=agent_id)

    def _measure_full(self, candidate_id: str, agent_id: str | None = None) -> dict:
        return self._measured("measure_full", MeasureResult, candidate_id, {"tier": "full", "valid": False},
                              agent_id=agent_id)

    def _check_bit_exact(self, candidate_id: str, mode: str = "bitwise", factor: float = 2.0,
                         floor: float = 1e-3, agent_id: str | None = None) -> dict:
        return self._measured("check_bit_exact", ExactResult, candidate_id, {}, agent_id=agent_id,
                              mode=mode, factor=factor, floor=floor)

    def _rollback(self, candidate_id: str = "reference", agent_id: str | None = None) -> dict:
        with self.device_lock:
            try:
                missing = self._ensure_installed(candidate_id)
                if missing is not None:
                    return missing
                r = self._device_call("rollback", {"candidate_id": candidate_id})
            except WorkerFailure as f:
                return {"ok": False, "error": str(f), "worker_restarted": True}
        self.ledger.record_event("rollback", {"active": r.get("active"), "ok": r.get("ok")},
                                 candidate_id=candidate_id, agent_id=agent_id)
        return r

    # -- local methods ----------------------------------------------------------------

    def _read_engine_source(self, path: str | None = None, start_line: int | None = None,
                            end_line: int | None = None, agent_id: str | None = None) -> dict:
        return snapshot.read(snapshot.SNAPSHOT_DIR, path, start_line, end_line,
                             reference=self.worker.info.get("family_source"))

    def _leaderboard(self, tier: str = "fast", limit: int = 20, agent_id: str | None = None) -> dict:
        metric = "measure_full" if tier == "full" else "measure_fast"
        rows = self.ledger.leaderboard(metric)[:limit]
        return {"ok": True, "tier": tier, "rows": rows}

    def _candidate_source(self, candidate_id: str, agent_id: str | None = None) -> dict:
        row = self.ledger.candidate(candidate_id)
        if row is None:
            return {"ok": False, "error": f"no candidate {candidate_id!r}"}
        return {"ok": True, "candidate_id": candidate_id, "name": row.get("name"), "parent": row.get("parent"),
                "agent_id": row.get("agent_id"), "stage": row.get("stage"), "source": row["source"]}

    def _traffic_profile(self, agent_id: str | None = None) -> dict:
        return {"ok": True, **self.profile}

    def _info(self, agent_id: str | None = None) -> dict:
        return {"ok": True, "pid": os.getpid(), "worker_pid": self.worker.proc.pid, "restarts": self.restarts,
                "uptime_s": round(time.time() - self.started_at, 1), "engine": self.worker.info,
                "ledger": str(self.ledger.path)}

    def close(self) -> None:
        self.worker.stop()


def _error_text(result: dict) -> str | None:
    err = result.get("error") if isinstance(result, dict) else None
    if isinstance(err, dict):
        return f"{err.get('stage')}: {err.get('type')}: {err.get('message')}"
    return err


# ---- HTTP ------------------------------------------------------------------------------

def make_app(sup: Supervisor, token: str):
    import hmac

    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def rpc(request: Request):
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
            return JSONResponse({"error": "missing or wrong token"}, status_code=401)
        try:
            params = await request.json()
        except ValueError:
            return JSONResponse({"error": "body must be a JSON object"}, status_code=400)
        if not isinstance(params, dict):
            return JSONResponse({"error": "body must be a JSON object"}, status_code=400)
        agent = request.headers.get("x-agent-id") or params.pop("agent_id", None)
        params.pop("agent_id", None)
        method = request.path_params["method"]
        result = await anyio.to_thread.run_sync(sup.handle, method, params, agent, abandon_on_cancel=True)
        return JSONResponse(strict_json(result))  # a NaN logit's max_abs_diff travels as "nan"

    async def health(request: Request):
        return JSONResponse({"ok": True, "model": sup.config.model, "device": sup.config.device,
                             "restarts": sup.restarts})

    return Starlette(routes=[Route("/rpc/{method}", rpc, methods=["POST"]), Route("/health", health)])


def check_loopback(host: str) -> None:
    if host not in LOOPBACK:
        raise ValueError(f"refusing to bind {host!r}: the engine listens on loopback only ({', '.join(LOOPBACK)})")


def write_token(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 0, home: str | Path | None = None,
          ready_file: Path | None = None) -> None:
    """Run the engine server in the foreground until SIGTERM/SIGINT."""
    import anyio
    import uvicorn

    check_loopback(host)
    home = state_dir(home)
    other = running_engine(home)
    if other is not None:  # a second engine here would replace its token and its engine.json
        raise RuntimeError(f"an engine is already running in {home} (pid {other.get('pid')}, {other.get('url')}); "
                           f"stop it or give another --home")
    token = write_token(home / "engine.token")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections queue from now on, so engine.json never names a refusing port
    port = sock.getsockname()[1]
    sup = Supervisor(config, home)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    info = {"url": url, "pid": os.getpid(), "token_file": str(home / "engine.token"), "model": config.model,
            "shrink": config.shrink, "device": config.device, "ledger": str(sup.ledger.path),
            "started": time.time()}
    write_atomic(home / "engine.json", json.dumps(info, indent=2))
    if ready_file:  # the launcher reads it as soon as it exists
        write_atomic(ready_file, json.dumps(info))
    print(f"tkcc engine on {url} (model {config.model}, device {config.device}); token in {info['token_file']}",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(sup, token), log_level="warning", lifespan="off"))
    # our own handlers: a graceful stop that exits 0 (uvicorn's re-raise the signal after shutdown)
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        anyio.run(lambda: server.serve(sockets=[sock]))
    finally:
        sup.close()
        try:
            if json.loads((home / "engine.json").read_text()).get("pid") == os.getpid():
                (home / "engine.json").unlink()
        except (OSError, ValueError):
            pass
        log.info("engine stopped")
