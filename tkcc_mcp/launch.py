"""Find the engine to talk to, or start one: shared by `tkcc mcp` and the campaign harness.

    url, token_file = ensure_engine(home, model="llama-3.2-1b")   # attach or start
    proc, info = start_engine(home, "llama-3.2-1b", shrink=True, device="cpu",
                              extra_args=["--call-timeout-s", "5"])   # always a new one
    stop_engine(info["pid"])

Contract:
- A healthy engine recorded in `$TKCC_HOME/engine.json` is used as it is, whatever model
  it serves (one engine per home; start another in another home). One that is alive but
  slow to answer is waited for, never doubled.
- Otherwise one is started with `tkcc engine start` DETACHED (its own session, stdin from
  /dev/null, stdout and stderr appended to `$TKCC_HOME/engine.log`): it outlives the MCP
  server that started it, and it never writes to that server's stdout (the stdio transport).
- An `fcntl.flock` on `$TKCC_HOME/engine.lock` serialises the check-and-start, so eight MCP
  servers launched at once start one engine: the first starts it, the others wait on the
  lock and then find it healthy. The kernel drops the lock if its holder dies.
- A start that fails (the process exits, or it is not ready within `timeout_s`) is killed
  and raises `EngineStartError` with the tail of engine.log.
- Defaults: device `cuda` if torch sees one, else `cpu`; shrink on for a preset or a
  config.json on the CPU (random weights at CPU size), off on CUDA and for model directories.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from engine_server.client import read_token, running_engine, state_dir
from engine_server.log import get_logger

log = get_logger("launch")

DEFAULT_MODEL = "llama-3.2-1b"
START_TIMEOUT_S = 900.0  # a large model's weights load in minutes on a cold disk
LAUNCHER = (sys.executable, "-m", "tkcc_mcp.cli")  # the command before `engine start`


class EngineStartError(RuntimeError):
    pass


def default_device() -> str:
    import torch  # only when an engine is to be started: attaching needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_shrink(model: str, device: str) -> bool:
    return device == "cpu" and not Path(model).expanduser().is_dir()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another process checks or starts
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_engine(home: str | Path | None = None, model: str = DEFAULT_MODEL, shrink: bool | None = None,
                  device: str | None = None, extra_args: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S,
                  env: dict[str, str] | None = None) -> tuple[str, Path]:
    """(url, token_file) of the engine in `home`, started first if none is healthy."""
    home = state_dir(home)
    with _locked(home / "engine.lock"):
        info = running_engine(home) or _busy_engine(home)
        if info is None:
            device = device or default_device()
            shrink = default_shrink(model, device) if shrink is None else shrink
            _, info = start_engine(home, model, shrink, device, extra_args, timeout_s, env=env)
        elif info.get("model") != model:
            log.warning("attaching to the running engine, which serves another model",
                        running=info.get("model"), asked=model, home=str(home))
    return info["url"], Path(info["token_file"])


def _busy_engine(home: Path, wait_s: float = 60.0) -> dict | None:
    """engine.json names a live engine that did not answer its health check (a loaded machine):
    wait for it rather than start a second engine on the same home, token and ledger."""
    try:
        info = json.loads((home / "engine.json").read_text())
        cmdline = Path(f"/proc/{info['pid']}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError):
        return None
    if b"engine" not in cmdline:  # a stale record whose pid now belongs to something else
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (info := running_engine(home)) is not None:
            return info
        time.sleep(1.0)
    raise EngineStartError(f"the engine in {home} (pid {info['pid']}) is running but does not answer "
                           f"{info['url']}/health; stop it or use another TKCC_HOME")


def start_engine(home: str | Path | None, model: str = DEFAULT_MODEL, shrink: bool = False, device: str = "cpu",
                 extra_args: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S,
                 env: dict[str, str] | None = None, launcher: Sequence[str] = LAUNCHER
                 ) -> tuple[subprocess.Popen, dict]:
    """Start an engine server in `home`, detached, and wait until it is ready. `extra_args` are
    more `tkcc engine start` flags; `env` is added to this process's (e.g. CUDA_VISIBLE_DEVICES).
    Returns the process and its engine.json record (url, pid, token_file, ...)."""
    home = state_dir(home)
    ready = home / f"engine.ready.{os.getpid()}"
    ready.unlink(missing_ok=True)
    cmd = [*launcher, "engine", "start", "--model", model, "--shrink" if shrink else "--no-shrink",
           "--device", device, "--home", str(home), "--ready-file", str(ready), *extra_args]
    log_path = home / "engine.log"
    with open(log_path, "ab") as logf:
        logf.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1", **(env or {})})
    log.info("starting engine", model=model, shrink=shrink, device=device, pid=proc.pid, log=str(log_path))
    t0, deadline = time.monotonic(), time.monotonic() + timeout_s
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise EngineStartError(f"the engine exited with code {proc.returncode} while starting; "
                                       f"{log_path} ends with:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                stop_engine(proc.pid)
                raise EngineStartError(f"the engine was not ready after {timeout_s:g} s and was stopped; "
                                       f"{log_path} ends with:\n{_tail(log_path)}")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
    finally:
        ready.unlink(missing_ok=True)
    read_token(info["token_file"])  # fail here, not on the first call, if it is unreadable
    log.info("engine ready", url=info["url"], seconds=round(time.monotonic() - t0, 1))
    return proc, info


def stop_engine(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM an engine server (it stops its worker and removes engine.json); SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _gone(pid):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it
        return done == pid
    except ChildProcessError:  # not our child: ask whether it exists
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
