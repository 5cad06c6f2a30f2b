"""Result types of the engine's methods (and so of the MCP tools).

Expected failures are data: a candidate that does not parse, raises, hangs, is not exact,
cheats or is slower comes back as one of these with `ok`/`exact`/`valid` false and an
`error` naming the stage. Only the engine's own bugs raise.
"""

from __future__ import annotations

import os
import platform
import sys
import traceback
from functools import lru_cache
from typing import Annotated

from pydantic import BaseModel, Field, PlainSerializer, WithJsonSchema

from engine_server.ledger import json_number

STAGES = ("parsed", "imported", "validated", "prepared", "warmed", "captured", "ready")


# a result's number: JSON has no NaN or infinity, so those travel as "nan"/"inf"/"-inf" (as the
# ledger stores them; pydantic reads them back as floats), and the schema agents see says so
Num = Annotated[float, PlainSerializer(json_number, return_type=float | str, when_used="json"),
                WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["nan", "inf", "-inf"]}]})]


class ErrorInfo(BaseModel):
    stage: str = Field(description="where it failed: parse, import, validate, prepare, warmup, capture, "
                                   "forward, timeout, worker, engine")
    type: str = Field(description="exception class name, e.g. SyntaxError, RuntimeError, TimeoutError")
    message: str
    traceback: str = Field("", description="the last frames, candidate lines included")

    @classmethod
    def from_exc(cls, stage: str, exc: BaseException, limit: int = 6) -> "ErrorInfo":
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-limit))
        return cls(stage=stage, type=type(exc).__name__, message=str(exc)[:2000], traceback=tb[-3000:])


class Hardware(BaseModel):
    device: str
    device_name: str
    torch: str
    cuda: str | None = None
    triton: str | None = None
    python: str
    platform: str
    cpus: int
    driver: str | None = None


@lru_cache(maxsize=None)
def hardware(device: str) -> Hardware:
    import torch

    name, driver, triton = platform.processor() or platform.machine(), None, None
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        try:
            import subprocess
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except Exception:  # no nvidia-smi: leave it out
            driver = None
    try:
        import triton as _t
        triton = _t.__version__
    except Exception:
        triton = None
    return Hardware(device=device, device_name=name, torch=torch.__version__, cuda=torch.version.cuda,
                    triton=triton, python=sys.version.split()[0], platform=platform.platform(),
                    cpus=os.cpu_count() or 1, driver=driver)


class InstallResult(BaseModel):
    candidate_id: str
    name: str | None = None
    parent: str | None = None
    ok: bool
    stage: str = Field(description="last stage reached: parsed, imported, validated, prepared, warmed, "
                                   "captured, ready")
    error: ErrorInfo | None = None
    prepare_bytes: int = Field(0, description="memory that prepare() allocated")
    graphs: list[str] = Field(default_factory=list, description="CUDA graphs captured, by shape")
    notes: list[str] = Field(default_factory=list, description="e.g. why it runs without CUDA graphs")
    seconds: Num = 0.0


class ShapeTiming(BaseModel):
    shape: str = Field(description="e.g. 'decode B=1 ctx=812'")
    batch: int
    context: int
    step_ms: Num = Field(description="candidate median time per decode step")
    reference_step_ms: Num
    speedup: Num
    spread_ms: Num = Field(description="interquartile range of the candidate's samples")
    tokens_per_s: Num
    weight: Num = Field(1.0, description="fast tier: ops of this kind in the full tier's replay")


class MeasureResult(BaseModel):
    candidate_id: str
    tier: str = Field(description="fast or full")
    ok: bool
    valid: bool = Field(True, description="false when a check of the timed outputs or the process failed")
    error: ErrorInfo | None = None
    violations: list[str] = Field(default_factory=list)
    speedup: Num = Field(0.0, description="reference time / candidate time, same call, A/B interleaved")
    speedup_ci95: tuple[Num, Num] = (0.0, 0.0)
    step_ms: Num = Field(0.0, description="candidate median time per decode step (mean over shapes)")
    reference_step_ms: Num = 0.0
    tokens_per_s: Num = Field(0.0, description="decode tokens/s of the candidate over the shapes")
    reference_tokens_per_s: Num = 0.0
    samples: int = Field(0, description="timed rounds per side after warm-up (fast tier: it may stop before "
                                        "config.rounds once speedup_ci95 is within +-config.target_ci; "
                                        "config.stopped says why it stopped)")
    layers: list[int] = Field(default_factory=list)
    shapes: list[ShapeTiming] = Field(default_factory=list)
    outputs_match: str = Field("", description="bitwise | close | differ: the timed outputs against the "
                                               "reference's on the same inputs")
    # full tier only
    requests: int = 0
    per_user_tps_p50: Num | None = None
    per_user_tps_p90: Num | None = None
    ttft_ms_p50: Num | None = None
    ttft_ms_p90: Num | None = None
    throughput_tps: Num | None = None
    reference_throughput_tps: Num | None = None
    tokens_match: Num | None = Field(None, description="share of replay steps whose greedy token equals "
                                                         "the reference's")
    near_ties: int | None = Field(None, description="replay steps whose differing tokens the reference ranks "
                                                    "within 2% of its top logit (allowed)")
    experts_active: Num | None = Field(None, description="MoE: distinct experts per layer per step (mean)")
    seconds: Num = 0.0
    hardware: Hardware | None = None
    config: dict = Field(default_factory=dict)


class Mismatch(BaseModel):
    phase: str = Field(description="prefill, decode, layers-subset or probe")
    step: int
    row: int
    index: int = Field(description="vocab index of the first differing logit")
    reference: Num
    candidate: Num


class TokenDivergence(BaseModel):
    """Where the candidate's greedy tokens first leave the reference's, and how close the
    choice was there. Both sides (and the wide run) had the same inputs up to that token."""
    phase: str = Field(description="prefill (the row's prompt) or decode")
    step: int = Field(description="decode step (prefill: 0)")
    row: int
    reference_token: int
    candidate_token: int
    reference_gap: Num = Field(description="the reference's logit of its token minus its logit of the candidate's")
    candidate_gap: Num = Field(description="the candidate's logit of its token minus its logit of the reference's")
    wide_gap: Num | None = Field(None, description="tolerance mode: the reference run in the wider dtype, its "
                                                     "logit of the reference's token minus that of the candidate's "
                                                     "(negative: it prefers the candidate's)")
    near_tie: bool = Field(description="the reference ranks the candidate's token among its top 8, within 2% of "
                                       "its top logit (measure.near_tie): what another summation order can flip")


class ExactResult(BaseModel):
    candidate_id: str
    ok: bool = Field(description="the check ran to the end (false: the candidate failed to run)")
    exact: bool = Field(False, description="bitwise equal logits and greedy tokens, and no violation")
    mode: str = "bitwise"
    close: bool | None = Field(None, description="tolerance mode: on every step no further from the reference run "
                                                 "in a wider dtype than `factor` times the reference itself, and "
                                                 "identical greedy tokens (never counts as exact)")
    candidate_error: Num | None = Field(None, description="tolerance mode: max |candidate - wide reference|")
    reference_error: Num | None = Field(None, description="tolerance mode: max |reference - wide reference|")
    tolerance_used: Num | None = Field(None, description="tolerance mode: worst step's candidate error over its "
                                                           "bound (at most 1 passes)")
    tolerance: dict | None = Field(None, description="tolerance mode: factor, floor and the wide dtype")
    steps: int = 0
    rows: int = 0
    tokens_equal: bool = False
    kv_equal: bool = False
    max_abs_diff: Num = 0.0
    first_mismatch: Mismatch | None = None
    token_divergence: TokenDivergence | None = Field(None, description="where the greedy tokens first differ "
                                                                       "(None: they never do)")
    violations: list[str] = Field(default_factory=list)
    error: ErrorInfo | None = None
    seconds: Num = 0.0
    hardware: Hardware | None = None
