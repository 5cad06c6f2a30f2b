"""The engine worker: the one process that owns the device.

Started by the supervisor (`server.py`) as `python -m engine_server.worker CONFIG_JSON`.
Protocol on its stdin/stdout, one JSON object a line:
    supervisor -> worker  {"id": n, "method": "measure_fast", "params": {...}}
    worker -> supervisor  {"id": n, "sealed": false}             (the call has run)
    supervisor -> worker  {"id": n, "nonce": s}                  (fresh, sent only now)
    worker -> supervisor  {"id": n, "nonce": s, "ok": true, "result": {...}}   (or "ok": false, "error": "...")
The first line the worker writes is {"id": 0, "ok": true, "result": {"ready": ...info}}. No
candidate call runs between the nonce's arrival and the reply, so none can learn it in time to
forge one (a thread a candidate left running could: the introspection guard and the checks
after the fact stand there); the supervisor restarts the worker on any line it did not ask for (and withdraws the
answer a late real reply shows was forged). An exception of the engine's own (not a candidate's,
which is a result) is answered with "fatal": true, and the worker exits for a restart.
Methods resolve to `Engine` methods of the same name; tensors never cross the pipe.
stdout carries only protocol lines: anything a candidate prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys

METHODS = {"submit_forward_pass", "measure_fast", "measure_full", "check_bit_exact", "rollback", "remove",
           "candidate_source", "traffic_profile", "info", "read_engine_source"}


def _dump(obj) -> dict:
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


def main(argv: list[str]) -> int:
    # keep the protocol channel to ourselves: fd 1 now points at stderr for everyone else
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import structlog

    from engine_server.engine import Engine, EngineConfig
    from engine_server.log import get_logger

    log = get_logger("worker")

    cfg = EngineConfig(**json.loads(argv[0]))
    try:
        eng = Engine(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which gives up
        proto.write(json.dumps({"id": 0, "ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps({"id": 0, "ok": True, "result": {"ready": True, **eng.info()}}, default=str) + "\n")
    lines = iter(sys.stdin)
    for line in lines:
        if not line.strip():
            continue
        req = json.loads(line)
        method, params = req.get("method"), req.get("params") or {}
        # every log line of this call names the agent and candidate it concerns
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(agent=req.get("agent"), candidate=params.get("candidate_id"))
        fatal = False
        if method not in METHODS:
            resp = {"ok": False, "error": f"unknown method {method!r}"}
        else:
            try:
                resp = {"ok": True, "result": _dump(getattr(eng, method)(**params))}
            except TypeError as e:  # bad parameters from the caller
                resp = {"ok": False, "error": f"bad parameters for {method}: {e}"}
            except Exception as e:  # noqa: BLE001 - the engine's own failure: say what, then start clean
                log.exception("internal error", method=method)
                resp = {"ok": False, "fatal": True, "error": f"{type(e).__name__}: {e}"}
                fatal = True
        # the call's nonce is asked for only now, after every line of candidate code it ran
        proto.write(json.dumps({"id": req.get("id"), "sealed": False}) + "\n")
        try:
            nonce = json.loads(next(lines)).get("nonce")
        except (StopIteration, ValueError, AttributeError):
            nonce = None
        proto.write(json.dumps({"id": req.get("id"), "nonce": nonce, **resp}, default=str) + "\n")
        if fatal:  # the supervisor restarts the worker: nothing half-done carries into the next call
            proto.flush()
            os._exit(1)  # now: a thread a candidate left running must not hold the exit up
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
