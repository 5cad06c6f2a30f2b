"""Install candidate files on one live engine and report, for each: bitwise exactness,
tolerance closeness with identical greedy tokens, fast- and full-tier speedups, memory.

    python benchmarks/candidates_bench.py --device cuda examples/candidates/*.py

Prints a card, then one JSON line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit, engine_args  # noqa: E402
from engine_server.engine import Engine, EngineConfig  # noqa: E402
from engine_server.results import hardware  # noqa: E402


def main() -> int:
    p = engine_args(argparse.ArgumentParser())
    p.add_argument("files", nargs="+")
    p.add_argument("--full", action="store_true", help="also run the full tier")
    a = p.parse_args()
    eng = Engine(EngineConfig(model=a.model, shrink=a.shrink, device=a.device))
    rows = []
    self_check = eng.check_bit_exact("reference")
    print(f"reference vs itself: exact={self_check.exact} first_mismatch={self_check.first_mismatch} "
          f"violations={self_check.violations}")
    for f in a.files:
        src = Path(f).read_text()
        if eng.cuda:
            torch.cuda.reset_peak_memory_stats()
        r = eng.submit_forward_pass(src, name=Path(f).stem)
        row = {"file": f, "ok": r.ok, "install_s": r.seconds, "prepare_bytes": r.prepare_bytes,
               "graphs": len(r.graphs), "notes": r.notes, "error": r.error.model_dump() if r.error else None}
        if r.ok:
            ex = eng.check_bit_exact(r.candidate_id)
            tol = eng.check_bit_exact(r.candidate_id, mode="tolerance")
            fm = eng.measure_fast(r.candidate_id)
            row |= {"exact": ex.exact, "first_mismatch": ex.first_mismatch.model_dump() if ex.first_mismatch else None,
                    "max_abs_diff": ex.max_abs_diff, "violations": ex.violations + fm.violations,
                    "tolerance_close": tol.close, "tokens_equal": tol.tokens_equal,
                    "fast_speedup": fm.speedup, "fast_ci95": fm.speedup_ci95, "fast_valid": fm.valid,
                    "shapes": [s.model_dump() for s in fm.shapes]}
            if a.full:
                full = eng.measure_full(r.candidate_id)
                row |= {"full_speedup": full.speedup, "full_ci95": full.speedup_ci95,
                        "full_tokens_per_s": full.tokens_per_s, "full_tokens_match": full.tokens_match}
            if eng.cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated()
        rows.append(row)
        print(f"{Path(f).stem:>28}: ok={r.ok} exact={row.get('exact')} close={row.get('tolerance_close')} "
              f"tokens_equal={row.get('tokens_equal')} fast x{row.get('fast_speedup', 0):.3f} "
              f"full x{row.get('full_speedup', 0):.3f} {('ERR ' + r.error.message[:200]) if r.error else ''}")
    res = {"bench": "candidates", "model": eng.model.name, "device": a.device, "dtype": eng.config.dtype,
           "reference_self_exact": self_check.exact, "rows": rows,
           "hardware": hardware(str(eng.device)).model_dump()}
    return emit(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
