#!/usr/bin/env bash
# The H200 runs behind benchmarks/results/h200_*: one stage a call, outputs under $OUT.
#
#   bash benchmarks/h200.sh forward|variants|next|attn|fidelity|cycle|fidelity+cycle|memory|engine|greedy|barrier|sync|stream|depth|fill|tests
#
# The GPU image has torch, Triton and transformers but not pydantic, structlog, starlette or
# uvicorn: `bash benchmarks/fetch_wheels.sh` puts their wheels in .whl/ (carry it), and they
# are installed to /tmp/site here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tkcc-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ -z "${TKCC_SITE:-}" ]] && compgen -G ".whl/*.whl" >/dev/null; then  # once a call (stages run stages)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TKCC_SITE=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader >"$OUT/nvidia_smi.txt"
ladder=(examples/candidates/llama_triton_decode.py examples/candidates/llama_triton_attn_norm.py
        examples/candidates/llama_triton_attention.py)
winners=(examples/candidates/llama_triton_decode_h200.py)  # evaluated beside the ladder, not climbed

case "${1:?stage}" in
forward)  # batch-1 decode: hill-climb the example candidates, against torch.compile and HF
    # (EXTRA: more candidate files, evaluated beside the winners, not climbed; TILINGS: a stream
    # stage's JSON, whose fastest tilings the climb tries first)
    python3 benchmarks/forward_bench.py --device cuda --budget-s "${BUDGET_S:-240}" --total-s "${TOTAL_S:-480}" \
        --climb llama_triton_decode ${START_KNOBS:+--start-knobs "$START_KNOBS"} ${TILINGS:+--tilings "$TILINGS"} \
        --winners-dir "$OUT/winners" "${ladder[@]}" "${winners[@]}" ${EXTRA:-} 2>&1 | tee "$OUT/forward.log"
    python3 benchmarks/profile_step.py --exact-repeats 0 --order --candidate "${ladder[0]}" >"$OUT/profile.txt" 2>&1 || true
    ;;
variants)  # KNOBS variants of a candidate (BASE, default the decode one) side by side (no climb),
    # and each one's kernel profile
    base=${BASE:-${ladder[0]}}
    python3 benchmarks/forward_bench.py --device cuda --budget-s 0 --skip-hf --skip-compile --no-full \
        --variants "${VARIANTS:?set VARIANTS to a JSON object: name -> KNOBS overrides}" \
        --winners-dir "$OUT/variants" --out "$OUT/variants.json" "$base" 2>&1 | tee "$OUT/variants.log"
    for f in "$base" "$OUT"/variants/variants/*.py; do  # PROFILE: only these variant names
        name=$(basename "$f" .py); name=${name#"$(basename "$base" .py)"-}
        [[ -z "${PROFILE:-}" || " $PROFILE " == *" $name "* ]] || continue
        python3 benchmarks/profile_step.py --exact-repeats 0 --order --resources --candidate "$f" \
            >"$OUT/profile_$(basename "$f" .py).txt" 2>&1 || true
    done
    ;;
next)  # one call for a GPU session: VARIANTS of BASE (the variants stage, under $OUT/v); if one
    # beat every base measurement by MARGIN (default 0.003; benchmarks/pick_variant.py), a forward
    # run with it beside the winner (under $OUT/f, BUDGET_S 0); then the GPU tests (under $OUT/t)
    OUT="$OUT/v" bash "$0" variants || true
    best=$(python3 benchmarks/pick_variant.py "$OUT/v/variants.json" --margin "${MARGIN:-0.003}" 2>"$OUT/pick.txt") || true
    cat "$OUT/pick.txt"
    if [[ -n "$best" ]]; then
        cp "$best" "$OUT/"
        EXTRA="$best" BUDGET_S=0 TOTAL_S="${TOTAL_S:-180}" OUT="$OUT/f" bash "$0" forward || true
    fi
    OUT="$OUT/t" bash "$0" tests
    ;;
attn)  # the decode example's attention kernels alone against the reference attention, shrunk and full preset
    for shrink in --shrink ""; do
        python3 benchmarks/attn_check.py --device cuda $shrink ${ATTN_SETTINGS:+--settings "$ATTN_SETTINGS"} \
            --out "$OUT/attn${shrink:+_shrunk}.json" 2>&1 | grep -v '^{' | tee "$OUT/attn${shrink:+_shrunk}.txt"
    done
    ;;
fidelity)  # Spearman of fast vs full tier over the agent's moves, hand-written variants and the ladder;
    # ALSO_FAST='{"name": {EngineConfig overrides}}' measures the fast tier under those settings too
    python3 benchmarks/fidelity_bench.py --device cuda --full-requests "${FULL_REQUESTS:-8}" --moves 4 \
        --variants 6 ${ALSO_FAST:+--also-fast "$ALSO_FAST"} --out "$OUT/fidelity.json" "${ladder[@]}" \
        2>&1 | tee "$OUT/fidelity.log"
    ;;
cycle)  # submit-to-fast-result on the live engine against a restart per experiment; tier costs
    python3 benchmarks/cycle_bench.py --device cuda --n "${N:-5}" --out "$OUT/cycle.json" 2>&1 | tee "$OUT/cycle.log"
    ;;
fidelity+cycle)
    bash "$0" fidelity && bash "$0" cycle
    ;;
memory)  # the H200 winner alone: peak GPU memory of the engine with it, what its install adds
    python3 benchmarks/forward_bench.py --device cuda --budget-s 0 --skip-hf --skip-compile --no-full \
        --out "$OUT/memory.json" "${winners[0]}" 2>&1 | tail -n 12 | cut -c1-400
    ;;
greedy)  # the greedy sampler inside a captured step: torch.argmax against engine_server.greedy;
    # PRODUCER=lm_head: after a PDL-launched lm_head GEMV (plain launches, PDL, PDL + advance)
    python3 benchmarks/greedy_bench.py --device cuda --producer "${PRODUCER:-none}" --out "$OUT/greedy.json" 2>&1 \
        | grep -v '^{' | tee "$OUT/greedy.txt"
    ;;
engine)
    python3 benchmarks/engine_bench.py --device cuda --repeats 3 --out "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log"
    ;;
barrier)  # the cost of one grid barrier of the persistent example
    python3 benchmarks/barrier_bench.py --out "$OUT/barrier.json" 2>&1 | tee "$OUT/barrier.txt"
    ;;
stream)  # the decode example's GEMV alone against the memory's read bandwidth, by tiling (SHAPES=)
    python3 benchmarks/stream_bench.py ${SHAPES:+--shapes "$SHAPES"} --out "$OUT/stream.json" 2>&1 \
        | grep -v '^{' | tee "$OUT/stream.txt"
    ;;
sync)  # what a dependency between two kernels costs: stream order, PDL's wait, a polled counter
    python3 benchmarks/sync_bench.py --out "$OUT/sync.json" 2>&1 | tee "$OUT/sync.txt"
    ;;
depth)  # the fast tier's depth check: what its rounds cost and catch (REPS: decode,prefill settings)
    python3 benchmarks/depth_check_bench.py --device cuda --n "${N:-10}" --reps ${REPS:-5,3 3,3} \
        --out "$OUT/depth_check.json" 2>&1 | grep -v '^{' | tee "$OUT/depth_check.txt"
    ;;
fill)  # shared memory filled by one program per SM (TMA, cp.async) against register loads
    python3 benchmarks/smem_fill_bench.py --out "$OUT/fill.json" 2>&1 | tee "$OUT/fill.txt"
    ;;
tests)
    python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
*) echo "unknown stage $1" >&2; exit 2 ;;
esac
