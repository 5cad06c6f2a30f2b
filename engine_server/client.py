"""Client of the engine server: HTTP+JSON on loopback, `POST /rpc/<method>` with the token.

    c = EngineClient.discover()            # the engine recorded in $TKCC_HOME/engine.json
    r = c.call("submit_forward_pass", source=src)
    c.call("measure_fast", candidate_id=r["candidate_id"])

Methods are the MCP tool names; results are the JSON of the engine's result models.
Transport failures raise `EngineUnavailable`; everything the engine says is a result.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
from pathlib import Path

import httpx

DEFAULT_TIMEOUT_S = 3600.0  # the server enforces per-method timeouts; this only bounds a lost server


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every request. httpx otherwise builds one per client, reading the CA
    bundle: about 25 ms, most of what a call on loopback cost. Each call still opens its own
    connection: a kept-alive one paid ~40 ms a call here (Nagle's algorithm against delayed ACKs
    on the request's second segment), against ~2.5 ms for a fresh one."""
    return ssl.create_default_context()


class EngineUnavailable(RuntimeError):
    pass


def state_dir(path: str | Path | None = None) -> Path:
    """Where a running engine leaves engine.json, its token and the ledger: $TKCC_HOME or ~/.tkcc."""
    d = Path(path or os.environ.get("TKCC_HOME") or Path.home() / ".tkcc").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_atomic(path: str | Path, text: str) -> None:
    """Write a state file whole or not at all: readers poll engine.json, ready files and
    records while they are written, and must never see one empty or cut short."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_token(path: str | Path) -> str:
    return Path(path).read_text().strip()


class EngineClient:
    def __init__(self, url: str, token: str, agent_id: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.agent_id = agent_id
        self.timeout = timeout

    @classmethod
    def discover(cls, home: str | Path | None = None, agent_id: str | None = None) -> "EngineClient":
        info = running_engine(home)
        if info is None:
            raise EngineUnavailable(f"no engine is running (nothing healthy in {state_dir(home) / 'engine.json'})")
        return cls(info["url"], read_token(info["token_file"]), agent_id)

    @classmethod
    def from_url(cls, url: str, token_file: str | Path | None = None, agent_id: str | None = None,
                 home: str | Path | None = None) -> "EngineClient":
        tf = token_file or state_dir(home) / "engine.token"
        return cls(url, read_token(tf), agent_id)

    def _headers(self) -> dict:
        h = {"Authorization": f"Bearer {self.token}"}
        if self.agent_id:
            h["X-Agent-Id"] = self.agent_id
        return h

    def call(self, method: str, **params) -> dict:
        try:
            r = httpx.post(f"{self.url}/rpc/{method}", json=params, headers=self._headers(), timeout=self.timeout,
                           verify=_tls())
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"engine at {self.url} unreachable: {e}") from None
        return _decode(r)

    async def acall(self, method: str, **params) -> dict:
        try:
            async with httpx.AsyncClient(timeout=self.timeout, verify=_tls()) as c:
                r = await c.post(f"{self.url}/rpc/{method}", json=params, headers=self._headers())
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"engine at {self.url} unreachable: {e}") from None
        return _decode(r)

    def health(self) -> dict:
        try:
            return httpx.get(f"{self.url}/health", timeout=5, verify=_tls()).json()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            raise EngineUnavailable(str(e)) from None


def _decode(r: httpx.Response) -> dict:
    if r.status_code in (401, 403):
        raise EngineUnavailable(f"engine refused the request ({r.status_code}): wrong or missing token")
    try:
        body = r.json()
    except json.JSONDecodeError:
        raise EngineUnavailable(f"engine answered {r.status_code} with non-JSON: {r.text[:200]}") from None
    if r.status_code >= 400 and "error" in body and len(body) == 1:
        raise EngineUnavailable(f"engine error {r.status_code}: {body['error']}")
    return body


def running_engine(home: str | Path | None = None) -> dict | None:
    """engine.json of a healthy engine, or None."""
    f = state_dir(home) / "engine.json"
    if not f.exists():
        return None
    try:
        info = json.loads(f.read_text())
        if httpx.get(f"{info['url']}/health", timeout=3, verify=_tls()).json().get("ok"):
            return info
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None
    return None
