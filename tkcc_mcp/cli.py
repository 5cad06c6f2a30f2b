"""The `tkcc` command. Subcommands map one-to-one onto the config dataclasses' fields."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine_server.engine import EngineConfig


def add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            p.add_argument(flag, type=typ, default=f.default, help=f"(default: {f.default!r})")


def config_from(args, cls):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tkcc", description="continual compilation for LLM inference")
    sub = p.add_subparsers(dest="cmd", required=True)

    eng = sub.add_parser("engine", help="the persistent engine").add_subparsers(dest="engine_cmd", required=True)
    sc = eng.add_parser("selfcheck", help="install the reference and a perturbed copy; check and measure both")
    add_dataclass_args(sc, EngineConfig)

    snap = sub.add_parser("snapshot", help="source snapshots agents read")
    snap.add_argument("action", choices=["regenerate", "check"])

    args = p.parse_args(argv)
    if args.cmd == "engine" and args.engine_cmd == "selfcheck":
        from engine_server.selfcheck import run
        run(config_from(args, EngineConfig))
        return 0
    if args.cmd == "snapshot":
        from engine_server import snapshot
        if args.action == "regenerate":
            print("\n".join(snapshot.regenerate()) or "up to date")
            return 0
        stale = snapshot.stale()
        print("\n".join(stale) or "up to date")
        return 1 if stale else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
