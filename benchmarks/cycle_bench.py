"""Experiment cycle time (submit -> fast-tier result) on the live engine, against restarting
the engine for every experiment (new process: load, prefill traffic, capture, measure), in
one run on one machine.

    python benchmarks/cycle_bench.py --model llama-3.2-1b --shrink --device cpu --n 5

Prints a card, then one JSON line (`host_speed`: this host's speed at the start and the end,
`benchmarks.common.host_speed`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args, host_line, host_speed  # noqa: E402
from engine_server.client import EngineClient  # noqa: E402
from engine_server.results import hardware  # noqa: E402

REF = Path(__file__).resolve().parent.parent / "engine_server" / "models"


def start(home: Path, a) -> tuple[subprocess.Popen, EngineClient]:
    home.mkdir(parents=True, exist_ok=True)
    ready, err = home / "ready.json", home / "stderr.log"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tkcc_mcp.cli", "engine", "start", "--model", a.model, "--device", a.device,
           "--home", str(home), "--ready-file", str(ready)] + (["--shrink"] if a.shrink else [])
    with err.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=os.environ | {"TKCC_LOG_LEVEL": "WARNING"})
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"engine failed to start (exit {proc.returncode}): {err.read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, EngineClient.from_url(info["url"], info["token_file"])


def experiment(c: EngineClient, source: str) -> dict:
    r = c.call("submit_forward_pass", source=source)
    m = c.call("measure_fast", candidate_id=r["candidate_id"])
    assert r["ok"] and m["ok"], (r, m)
    return {"candidate_id": r["candidate_id"], "install_s": r["seconds"], "fast_s": m["seconds"],
            "rounds": m["samples"], "speedup_ci95": m["speedup_ci95"], "phases_s": m["config"].get("phases_s")}


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--full", type=int, default=2, help="measure_full calls on the live engine (tier cost)")
    a = p.parse_args()
    family = "llama"
    source = (REF / f"{family}.py").read_text()
    live, restart, inside, full_s = [], [], [], []
    host = {"start": host_speed()}
    with tempfile.TemporaryDirectory() as tmp:
        proc, c = start(Path(tmp) / "live", a)
        experiment(c, source)  # the first call pays one-off costs; a live engine has paid them
        for i in range(a.n):
            t = time.perf_counter()
            e = experiment(c, source + f"\n# live experiment {i}\n")
            live.append(time.perf_counter() - t)
            inside.append(e)
        c.call("measure_full", candidate_id=e["candidate_id"])  # builds the replay schedule once
        for _ in range(a.full):
            full_s.append(c.call("measure_full", candidate_id=e["candidate_id"])["seconds"])
        tiers = {"fast_s": [x["fast_s"] for x in inside], "full_s": full_s}
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        for i in range(a.n):
            t = time.perf_counter()
            proc, c = start(Path(tmp) / f"cold{i}", a)
            experiment(c, source + f"\n# cold experiment {i}\n")
            restart.append(time.perf_counter() - t)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    host["end"] = host_speed()
    q = lambda xs, k: statistics.quantiles(xs, n=10)[k - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    res = {"bench": "cycle", "model": a.model, "shrink": a.shrink, "device": a.device, "n": a.n,
           "live_s": {"p50": statistics.median(live), "p90": q(live, 9), "all": live},
           "restart_s": {"p50": statistics.median(restart), "p90": q(restart, 9), "all": restart},
           "ratio_p50": statistics.median(restart) / statistics.median(live),
           "live_inside_engine": inside, "tier_s": tiers,
           "full_over_fast": (statistics.median(tiers["full_s"]) / statistics.median(tiers["fast_s"])
                              if tiers["full_s"] else None),
           "experiments_per_hour_live": 3600 / statistics.median(live),
           "experiments_per_hour_restart": 3600 / statistics.median(restart),
           "hardware": hardware(a.device).model_dump(), "host_speed": host}
    print(f"== experiment cycle (submit -> fast-tier result), {a.model}{' shrunk' if a.shrink else ''} on {a.device}")
    print(f"live engine:        P50 {res['live_s']['p50']:.3f} s  P90 {res['live_s']['p90']:.3f} s  "
          f"({res['experiments_per_hour_live']:.0f} experiments/hour)")
    print(f"restart per run:    P50 {res['restart_s']['p50']:.3f} s  P90 {res['restart_s']['p90']:.3f} s  "
          f"({res['experiments_per_hour_restart']:.0f} experiments/hour)")
    print(f"live is {res['ratio_p50']:.1f}x faster per experiment")
    print(host_line(host))
    if res["full_over_fast"]:
        print(f"tiers inside the engine: measure_fast P50 {statistics.median(tiers['fast_s']):.3f} s, "
              f"measure_full P50 {statistics.median(tiers['full_s']):.3f} s: the fast tier is "
              f"{res['full_over_fast']:.1f}x cheaper")
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
