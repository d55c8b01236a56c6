#!/usr/bin/env bash
# CUDA acceptance run of megatrain-lightning, sized for a short GPU lease: one Python process (bench/gpu_check.py)
# runs the checks in sequence under `timeout`, within GPU_CHECK_BUDGET_S (default 420 s, imports included).
#   bash bench/gpu_check.sh                      # default checks: env stream_parity nccl_group phases nvme depth
#   bash bench/gpu_check.sh memory overlap       # only these (further checks by name: bench/gpu_check_extra.py)
#   bash bench/gpu_check.sh --cpu-dry-run        # every selected check on the CPU with tiny sizes
#   PEER_SHAPES=0p9b,max bash bench/gpu_check.sh peer   # the peer benchmark with the max shape too
# Each check appends its JSON row to gpu_check.jsonl as soon as it ends (and rewrites gpu_check.json), in $OUT when
# it is set, else in bench/results/ (dry run: ${TMPDIR:-/tmp}/gpu_check_dryrun/); the log is gpu_check.log there.
# The peer check's torchao wheel is not in git (bench/wheels/, ignored, filled by bench/fetch_wheels.sh): carry it
# to the device machine; it is installed offline (pip --no-index, else unzipped onto PYTHONPATH) when torchao does
# not import. PEER_DEEPSPEED=1 also installs bench/wheels/deepspeed/ (sdist + pure deps) to try ZeRO-3 offload.
set -u
START=$(date +%s)
cd "$(dirname "$0")/.."

DRY=""
RESULTS=bench/results
ARGS=()
for arg in "$@"; do
    if [ "$arg" = "--cpu-dry-run" ]; then
        DRY="--cpu-dry-run"
        RESULTS=${TMPDIR:-/tmp}/gpu_check_dryrun
    else
        ARGS+=("$arg")
    fi
done
BUDGET=${GPU_CHECK_BUDGET_S:-420}
DEST=${OUT:-$RESULTS}
mkdir -p "$RESULTS" "$DEST"
LOG=$DEST/gpu_check.log

setup() {
    if [ -f .venv/bin/activate ]; then
        . .venv/bin/activate
    elif ! python3 -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("torch", "lightning", "transformers", "safetensors")))' 2>/dev/null; then
        echo "== torch/lightning/transformers/safetensors missing and the device machine is offline: carry wheels"
    fi
    # the GPU image already has torch (CUDA), lightning, transformers and safetensors: no install (it is offline);
    # the engine needs nothing else (hydra/omegaconf are only for the recipes)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}

# offline installs for the peer check (the device machine has no network): torchao, and DeepSpeed when asked
peer_wheels() {
    [ -n "$DRY" ] && return  # never into the dry run's (developer's) environment
    if ! python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torchao") is None)' 2>/dev/null; then
        local whl
        whl=$(ls bench/wheels/torchao-*.whl 2>/dev/null | head -1)
        if [ -z "$whl" ]; then
            echo "== peer: torchao missing and no bench/wheels/torchao-*.whl (carry bench/wheels)"
        elif ! python3 -m pip install --no-index --no-deps "$whl"; then
            local site=${TMPDIR:-/tmp}/peer_site
            python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$site" \
                && export PYTHONPATH=$site:$PYTHONPATH && echo "== peer: torchao unzipped onto PYTHONPATH ($site)"
        fi
    fi
    if [ "${PEER_DEEPSPEED:-0}" = 1 ] && ! python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("deepspeed") is None)' 2>/dev/null; then
        DS_BUILD_OPS=0 python3 -m pip install --no-index --find-links bench/wheels/deepspeed --no-build-isolation deepspeed \
            || echo "== peer: DeepSpeed offline install failed"
    fi
}

main() {
    setup
    case " $* " in *" peer "*) peer_wheels;; esac
    local left=$((BUDGET - ($(date +%s) - START)))
    # the runner keeps to the budget itself (rows written as each check ends); timeout is the backstop
    GPU_CHECK_START=$START GPU_CHECK_BUDGET_S=$BUDGET timeout -k 5 "$left" \
        python3 bench/gpu_check.py $DRY --results "$RESULTS" "$@"
}

main ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
    # result files of the further checks (their scripts write into the results folder)
    # (only those this run wrote: the tracked results of earlier runs would take $OUT's few file slots)
    find "$RESULTS" -maxdepth 1 -newermt "@$START" \( -name 'memory_depth_*.json' -o -name 'overhead_*.json' \
        -o -name 'pinned_*.json' -o -name 'recompute_policy_*.json' -o -name 'scaling_*.json' -o -name 'peer*.json' \) \
        -exec cp {} "$OUT"/ \; 2>/dev/null
fi
echo "total $(($(date +%s) - START))s, exit $rc"
exit $rc
