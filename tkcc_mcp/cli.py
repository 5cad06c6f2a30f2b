"""The `tkcc` command. Subcommands map one-to-one onto the config dataclasses' fields."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine_server.config import EngineConfig


def field_help(cls) -> dict[str, str]:
    """Each field's comment in the class's source, continuation lines joined: the --help text
    comes from where the field is defined."""
    import inspect
    import re
    out, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"    (\w+): [^=]+=.*?  # (.*)$", line):
            out[m[1]], last = m[2], m[1]
        elif re.match(r"    (\w+):", line):
            last = None
        elif (m := re.match(r"    # (.*)$", line)) and last:
            out[last] += " " + m[1]
    return out


def add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    said = field_help(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if cls is EngineConfig and f.name == "shrink":  # None: chosen for the device (config_from)
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help="a CPU-sized copy of the model's config (default: on for a preset or "
                                "config.json on the CPU, off on CUDA and for a model directory)")
        else:
            text = (said.get(f.name, "") + f" (default: {f.default!r})").strip().replace("%", "%%")
            if f.type in ("bool", bool):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
            else:
                typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
                p.add_argument(flag, type=typ, default=f.default, help=text)


def config_from(args, cls):
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    if cls is EngineConfig and kw.get("shrink") is None:
        from tkcc_mcp.launch import default_shrink
        kw["shrink"] = default_shrink(kw.get("model", ""), kw.get("device", "cpu"))
    return cls(**kw)


def main(argv: list[str] | None = None) -> int:
    """Run one command. An expected failure (a missing file, a bad setting, no GPU) is one line on
    stderr and exit status 1; TKCC_DEBUG=1 shows its traceback."""
    import os
    args = parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a command line says what went wrong in a line
        if os.environ.get("TKCC_DEBUG"):
            raise
        print(f"tkcc: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tkcc", description="continual compilation for LLM inference")
    sub = p.add_subparsers(dest="cmd", required=True)

    eng = sub.add_parser("engine", help="the persistent engine").add_subparsers(dest="engine_cmd", required=True)
    sc = eng.add_parser("selfcheck", help="install the reference and a perturbed copy; check and measure both")
    add_dataclass_args(sc, EngineConfig)

    st = eng.add_parser("start", help="run the engine server (foreground; SIGTERM stops it)")
    add_dataclass_args(st, EngineConfig)
    st.add_argument("--host", default="127.0.0.1", help="a loopback address")
    st.add_argument("--port", type=int, default=0, help="0 picks a free port")
    st.add_argument("--home", default=None, help="state directory (default $TKCC_HOME or ~/.tkcc)")
    st.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)

    led = sub.add_parser("ledger", help="candidates, calls and events of an engine",
                         description="list: the candidates with their best fast-tier speedup and exactness "
                                     "(--agent filters); show ID: one candidate, its calls and events, as JSON; "
                                     "export: a whole table (--table, --format, --agent filters).")
    led.add_argument("action", choices=["list", "show", "export"])
    led.add_argument("target", nargs="?", help="show: a candidate id")
    led.add_argument("--home", default=None, help="the engine's state directory (default $TKCC_HOME or ~/.tkcc)")
    led.add_argument("--db", default=None, help="ledger file (default: HOME/ledger.db)")
    led.add_argument("--format", choices=["json", "csv"], default=None, help="export: json (default) or csv")
    led.add_argument("--table", choices=["calls", "candidates", "events"], default=None,
                     help="export: which table (default calls)")
    led.add_argument("--agent", default=None, help="list, export: only this agent's rows")

    snap = sub.add_parser("snapshot", help="source snapshots agents read")
    snap.add_argument("action", choices=["regenerate", "check"])

    mc = sub.add_parser("mcp", help="MCP server: the engine as tools for one agent (stdio by default)",
                        description="Without --engine: attach to the engine in $TKCC_HOME/engine.json if it "
                                    "is healthy, else start one (detached, log in $TKCC_HOME/engine.log).")
    mc.add_argument("--engine", metavar="URL", default=None, help="attach to this running engine")
    mc.add_argument("--token-file", default=None, help="the engine's token (default: $TKCC_HOME/engine.token)")
    mc.add_argument("--home", default=None, help="state directory (default $TKCC_HOME or ~/.tkcc)")
    mc.add_argument("--agent-id", default=None, help="recorded with every call (default: mcp-<pid>)")
    mc.add_argument("--http", type=int, metavar="PORT", default=None,
                    help="serve streamable HTTP on http://127.0.0.1:PORT/mcp instead of stdio")
    mc.add_argument("--host", default="127.0.0.1", help="with --http: a loopback address only")
    mc.add_argument("--model", default="llama-3.2-1b", help="for an engine this starts")
    mc.add_argument("--shrink", action=argparse.BooleanOptionalAction, default=None,
                    help="for an engine this starts (default: on for presets on the CPU, off on CUDA)")
    mc.add_argument("--device", default=None, help="for an engine this starts (default: cuda if available)")
    mc.add_argument("--start-timeout-s", type=float, default=900.0, help="wait this long for it to start")

    from engine_server import drift, serving
    from tkcc_mcp import ablate, campaign, replay
    campaign.add_parser(sub)
    ablate.add_parser(sub)
    serving.add_parser(sub, add_dataclass_args)
    drift.add_parser(sub, add_dataclass_args)
    replay.add_parser(sub)

    return p


def run(args) -> int:
    from tkcc_mcp import ablate, campaign, replay
    from engine_server import drift, serving
    if args.cmd == "engine" and args.engine_cmd == "selfcheck":
        from engine_server.selfcheck import run
        run(config_from(args, EngineConfig))
        return 0
    if args.cmd == "engine" and args.engine_cmd == "start":
        from engine_server.server import serve
        serve(config_from(args, EngineConfig), host=args.host, port=args.port, home=args.home,
              ready_file=args.ready_file)
        return 0
    if args.cmd == "mcp":
        from tkcc_mcp.server import run as run_mcp
        return run_mcp(engine=args.engine, token_file=args.token_file, home=args.home, agent_id=args.agent_id,
                       http=args.http, host=args.host, model=args.model, shrink=args.shrink,
                       device=args.device, start_timeout_s=args.start_timeout_s)
    if args.cmd == "campaign":
        return campaign.main(args)
    if args.cmd == "ablate":
        return ablate.main(args)
    if args.cmd == "serve":
        return serving.main(args)
    if args.cmd == "traffic":
        return drift.main(args)
    if args.cmd == "replay":
        return replay.main(args)
    if args.cmd == "ledger":
        return ledger_command(args)
    if args.cmd == "snapshot":
        from engine_server import snapshot
        if args.action == "regenerate":
            print("\n".join(snapshot.regenerate()) or "up to date")
            return 0
        stale = snapshot.stale()
        print("\n".join(stale) or "up to date")
        return 1 if stale else 0
    return 2


def ledger_command(args) -> int:
    import json as _json

    from engine_server.client import state_dir
    from engine_server.ledger import Ledger, format_table

    db = Path(args.db) if args.db else state_dir(args.home) / "ledger.db"
    if not db.is_file():
        print(f"tkcc ledger: no ledger at {db} (an engine writes one in its home: --home DIR or --db FILE)",
              file=sys.stderr)
        return 1
    wrong = [flag for flag, given, where in (("ID", args.target, ("show",)), ("--format", args.format, ("export",)),
                                              ("--table", args.table, ("export",)),
                                              ("--agent", args.agent, ("list", "export")))
             if given is not None and args.action not in where]
    if wrong:
        print(f"tkcc ledger {args.action}: {', '.join(wrong)} does not apply (see tkcc ledger --help)", file=sys.stderr)
        return 2
    led = Ledger(db)
    if args.action == "list":
        rows = led.candidates(agent_id=args.agent)
        board = {r["candidate_id"]: r for r in led.leaderboard()}
        for r in rows:
            b = board.get(r["id"], {})
            r["speedup"] = None if b.get("speedup") is None else round(b["speedup"], 4)
            r["exact"] = b.get("exact")
        print(format_table(rows, ["id", "name", "agent_id", "parent", "stage", "ok", "speedup", "exact"]))
        return 0
    if args.action == "show":
        if not args.target:
            print("tkcc ledger show: give a candidate id", file=sys.stderr)
            return 2
        c = led.candidate(args.target)
        if c is None:
            print(f"no candidate {args.target!r} in {db}", file=sys.stderr)
            return 1
        c["calls"] = led.calls(candidate_id=args.target)
        c["events"] = led.events(candidate_id=args.target)
        print(_json.dumps(c, indent=2, default=str))
        return 0
    led.export(args.format or "json", args.table or "calls", sys.stdout, agent_id=args.agent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
