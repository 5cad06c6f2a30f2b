"""What every benchmark script shares: the engine flags and the closing JSON line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shrink", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def emit(res: dict, out: str | None) -> int:
    """Record the command, print the one JSON line scripts read (last), write --out."""
    res.setdefault("command", " ".join(["python"] + sys.argv))
    print(json.dumps(res, default=str))
    if out:
        Path(out).write_text(json.dumps(res, indent=2, default=str))
    return 0
