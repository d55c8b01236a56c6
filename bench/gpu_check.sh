#!/usr/bin/env bash
# CUDA acceptance run of megatrain-lightning: one entry point for a short GPU lease.
#   bash bench/gpu_check.sh                # on the GPU machine, from a fresh checkout (at most 9 minutes)
#   bash bench/gpu_check.sh memory nvme    # only these checks (a second call for what the budget skipped)
#   bash bench/gpu_check.sh --cpu-dry-run  # everything on the CPU with tiny sizes (exercises the logic)
#   PEER_SHAPES=0p9b,max bash bench/gpu_check.sh peer   # the peer benchmark with the max shape too (540 s)
# The peer check's torchao wheel is not in git (bench/wheels/, ignored): the device tool must carry it,
# run(carry=["bench/wheels"]); it is installed offline (pip --no-index, else unzipped onto PYTHONPATH) when torchao
# does not import. PEER_DEEPSPEED=1 also installs bench/wheels/deepspeed/ (sdist + pure deps) to try ZeRO-3 offload.
# Checks (see bench/gpu_check.py), in the order that closes open issues first: env, scaling (12), d2h, pinned, memory (17), parity, recompute, peer (14), long, overlap, precision,
# overhead, nvme, pytest (engine tests); each under its own timeout inside a global budget (GPU_CHECK_BUDGET_S,
# default 540 s), continuing after failures; a check the budget skips is reported SKIP (run it in a second call).
# Writes bench/results/gpu_check.json, gpu_check.log, memory_depth_cuda.json, overhead_cuda.json, pinned_cuda.json,
# recompute_policy_cuda*.json, scaling_gpu.json, peer.json
# (dry run: into ${TMPDIR:-/tmp}/gpu_check_dryrun instead) and copies them to $OUT when it is set.
set -u
cd "$(dirname "$0")/.."

DRY=""
RESULTS=bench/results
if [ "${1:-}" = "--cpu-dry-run" ]; then
    DRY="--cpu-dry-run"
    RESULTS=${TMPDIR:-/tmp}/gpu_check_dryrun
    shift
fi
# newest checks first (those never run on a GPU yet): a lease that ends early still measured them;
# `bash bench/gpu_check.sh [--cpu-dry-run] CHECK...` runs only those (e.g. a second call for the rest)
DEFAULT="env scaling d2h pinned memory parity recompute peer long overlap precision overhead nvme pytest"
SELECTED="${*:-$DEFAULT}"
BUDGET=${GPU_CHECK_BUDGET_S:-540}
mkdir -p "$RESULTS"
LOG=$RESULTS/gpu_check.log
PARTS=$(mktemp -d)
START=$(date +%s)

setup() {
    if [ -f .venv/bin/activate ]; then
        . .venv/bin/activate
    elif ! python3 -c 'import torch, lightning, transformers, safetensors' 2>/dev/null; then
        echo "== torch/lightning/transformers/safetensors missing and the device machine is offline: carry wheels"
    fi
    # the GPU image already has torch (CUDA), lightning, transformers and safetensors: no install (it is
    # offline); the engine needs nothing else (hydra/omegaconf are only for the recipes)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import torch; print("torch", torch.__version__, "cuda available", torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' || echo "torch import failed"
}

# run_check NAME LIMIT_S: run one check under min(LIMIT_S, budget left); SKIP when under 20 s remain
run_check() {
    local name=$1 limit=$2 left
    left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "{\"result\": \"SKIP\", \"numbers\": {\"why\": \"global budget ${BUDGET}s spent\"}}" > "$PARTS/$name.json"
        return
    fi
    local t0=$(date +%s)
    echo; echo "== $name (timeout ${limit}s, $((t0 - START))s elapsed)"
    GPU_CHECK_LIMIT_S=$limit timeout -k 10 "$limit" python3 bench/gpu_check.py "$name" $DRY --parts "$PARTS" --results "$RESULTS"
    echo "$? $(($(date +%s) - t0))" > "$PARTS/$name.rc"
}

limit_of() {  # seconds each check may take on the H200 (the dry run fits these on 2 CPU cores too)
    case $1 in
        env) echo 60;; parity) echo 120;; precision) echo 60;; memory) echo 90;; overlap) echo 150;;
        d2h) echo 90;; overhead) echo 120;; recompute) echo 240;; nvme) echo 90;; pinned) echo 60;;
        long) echo 120;; pytest) echo 90;; scaling) echo 150;;
        peer) case ${PEER_SHAPES:-0p9b} in *max*) echo 540;; *) echo 240;; esac;; *) echo 0;;
    esac
}

# offline installs for the peer check (the device machine has no network): torchao, and DeepSpeed when asked
peer_wheels() {
    [ -n "$DRY" ] && return  # never into the dry run's (developer's) environment
    if ! python3 -c 'import torchao' 2>/dev/null; then
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
    if [ "${PEER_DEEPSPEED:-0}" = 1 ] && ! python3 -c 'import deepspeed' 2>/dev/null; then
        DS_BUILD_OPS=0 python3 -m pip install --no-index --find-links bench/wheels/deepspeed --no-build-isolation deepspeed \
            || echo "== peer: DeepSpeed offline install failed"
    fi
}

main() {
    setup
    case " $SELECTED " in *" peer "*) peer_wheels;; esac
    for c in $SELECTED; do
        if [ "$(limit_of "$c")" = 0 ]; then echo "unknown check $c (known: $DEFAULT)"; continue; fi
        run_check "$c" "$(limit_of "$c")"
    done
    python3 bench/gpu_check.py summary $DRY --parts "$PARTS" --results "$RESULTS" --total-s $(($(date +%s) - START)) \
        --checks "$SELECTED"
}

main 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
rm -rf "$PARTS"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$RESULTS"/gpu_check.json "$RESULTS"/gpu_check.log "$RESULTS"/memory_depth_*.json "$RESULTS"/overhead_*.json "$RESULTS"/pinned_*.json "$RESULTS"/recompute_policy_*.json "$RESULTS"/scaling_*.json "$RESULTS"/peer*.json "$OUT"/ 2>/dev/null
fi
echo "total $(($(date +%s) - START))s, exit $rc"
exit $rc
