"""`tkcc engine selfcheck`: build the engine, install the reference unchanged and a perturbed
copy, check and measure both, and report. The last line printed is one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

from engine_server.engine import Engine, EngineConfig


def reference_source(eng: Engine) -> str:
    """The loaded model's reference forward pass, as a candidate module's text."""
    return Path(eng.family.__file__).read_text()


def perturbed_source(eng: Engine, eps: float = 1e-6) -> str:
    """The reference with a tiny epsilon added to its logits: must not count as exact."""
    mod = eng.family.__name__
    return (f"import {mod} as _ref\n\n\ndef forward(state, batch):\n"
            f"    return _ref.forward(state, batch) + {eps!r}\n")


def run(config: EngineConfig, out=print) -> dict:
    eng = Engine(config)
    ref = eng.submit_forward_pass(reference_source(eng), name="reference-copy")
    pert = eng.submit_forward_pass(perturbed_source(eng), name="perturbed")
    report = {"model": eng.model.name, "model_type": eng.model.model_type, "device": eng.config.device,
              "dtype": eng.config.dtype, "weights": eng.weights_source, "startup_s": round(eng.startup_s, 3)}
    for label, r in (("reference", ref), ("perturbed", pert)):
        if not r.ok:
            report[f"exact_{label}"] = False
            report[f"error_{label}"] = r.error.model_dump()
            continue
        ex = eng.check_bit_exact(r.candidate_id)
        fm = eng.measure_fast(r.candidate_id)
        report[f"exact_{label}"] = ex.exact
        report[f"speedup_fast_{label}"] = round(fm.speedup, 4)
        report[f"speedup_fast_ci95_{label}"] = [round(x, 4) for x in fm.speedup_ci95]
        if ex.first_mismatch:
            report[f"first_mismatch_{label}"] = ex.first_mismatch.model_dump()
        report[f"max_abs_diff_{label}"] = ex.max_abs_diff
        report[f"tokens_per_s_{label}"] = round(fm.tokens_per_s, 2)
        out(f"{label:>10}: install {r.seconds:.2f}s  exact={ex.exact}  max|diff|={ex.max_abs_diff:.3g}  "
            f"fast speedup {fm.speedup:.3f} [{fm.speedup_ci95[0]:.3f}, {fm.speedup_ci95[1]:.3f}]  "
            f"{fm.tokens_per_s:.1f} tok/s" + (f"  first mismatch: {ex.first_mismatch.phase} step "
                                               f"{ex.first_mismatch.step} row {ex.first_mismatch.row} "
                                               f"index {ex.first_mismatch.index}" if ex.first_mismatch else ""))
    report["speedup_fast"] = report.get("speedup_fast_reference")
    if eng.model.is_moe:
        report["experts_active"] = eng.fast_setup.experts_active
    out(f"model {eng.model.name} ({eng.model.model_type}, weights: {eng.weights_source}), "
        f"{eng.model.num_layers} layers, fast tier layers "
        f"{list(eng.fast_layers)}, shapes: {', '.join(s.name for s in eng.fast_setup.shapes)}")
    out(json.dumps(report))
    return report
