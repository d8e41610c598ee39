#!/usr/bin/env bash
# The GPU measurements of the attack-step performance work (docs/performance.md, "On a GPU"), in one
# command for a lent GPU machine, cheapest and most valuable first:
#   env           nvidia-smi, torch and CUDA versions
#   eff32         bench_efficiency.py at the CIFAR-10 zoo's shape (32 px, batch 64), every family:
#                 default (the model as given, lean paths: what the attacks query on CUDA), reference,
#                 the attack copy, bf16 autocast, and CUDA graphs of the lean and reference steps
#   eff224        SAN10 (pairwise, patchwise) against ResNet-26 at 224 px, width 1.0, batch 64:
#                 lean, reference, CUDA graphs, bf16 (the goal: SAN10 at 0.5x ResNet-26's images/s)
#   eff224-compiled  the same families: lean against torch.compile of the reference and lean paths
#   pytest-cuda   the CUDA cases of tests/test_attack_step_paths.py and tests/test_bench_efficiency.py
#                 (lean and reference paths, the attack copy: the same function in float64 on CUDA)
#   eff32-compiled   32 px: default against torch.compile of it, in the time left
# Each step runs under `timeout` and within an overall budget (GPU_SESSION_BUDGET_S, 480 s), so the
# whole script ends in about 8 minutes on an H100 or H200; a failing or timed-out step is recorded
# and the next one runs. bench_efficiency.py writes each family's row as it is measured, so a step
# stopped by its limit keeps the rows it finished ("complete": false in its file).
#
# Where: from the repository root (`bash benchmarks/gpu_session.sh`). Results go to $OUT (the device
# tool's output folder; default runs/gpu-session): session.log (everything printed, with timestamps),
# steps.tsv (step, status, exit code, seconds) and one JSON per benchmark step, 6 files in all (the
# device tool brings back at most 8). The last lines printed are steps.tsv and each family's best
# variant against resnet26's (the SUMMARY lines).
#
# Python: $PYTHON, else .venv/bin/python where it exists, else python3. The README's install
# (`python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ".[dev]"`) cannot run on
# the lent machines: they reach no package registry (/work/.library/device/KINDS.md), and
# constraints.txt pins the CPU machine's torch. Their python3 already has torch with CUDA (2.11.0+cu130
# when last seen), numpy, safetensors, tqdm and pytest, which is all these steps import (the
# benchmarks and tests here need neither torchattacks nor foolbox), so the script uses it as it is,
# with the repository on PYTHONPATH: no install step.
#
# What travels: the device tool copies the session's checkout, at most 64 MiB; the repository's tracked
# files are about 130 MiB, 59 of them reports/ and 21 zoo/checkpoints/fashion_mnist/, which these steps
# do not read. See docs/performance.md, "On a GPU", for a checkout small enough to send.
#
# Overrides (for a smoke run on a CPU, e.g. GPU_SESSION_DEVICE=cpu with small shapes):
# GPU_SESSION_DEVICE (cuda), GPU_SESSION_BATCH (64), GPU_SESSION_BATCH_224 (64), GPU_SESSION_SIZE_224
# (224), GPU_SESSION_WIDTH_224 (1.0), GPU_SESSION_REPEATS (10), GPU_SESSION_FAMILIES (all seven),
# GPU_SESSION_FAMILIES_224 (resnet26,san10_pairwise,san10_patchwise), GPU_SESSION_BUDGET_S (480),
# GPU_SESSION_SKIP (step names to leave out, space-separated).
# GPU_SESSION_DRY_RUN=1 checks every step's options (bench_efficiency.py --dry-run, pytest
# --collect-only) without measuring or needing a GPU.
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-runs/gpu-session}"
DEVICE="${GPU_SESSION_DEVICE:-cuda}"
BATCH="${GPU_SESSION_BATCH:-64}"
BATCH_224="${GPU_SESSION_BATCH_224:-64}"
SIZE_224="${GPU_SESSION_SIZE_224:-224}"
WIDTH_224="${GPU_SESSION_WIDTH_224:-1.0}"
REPEATS="${GPU_SESSION_REPEATS:-10}"
FAMILIES="${GPU_SESSION_FAMILIES:-resnet26,san10_pairwise,san10_patchwise,sasa_resnet26,gsa_resnet26,aa_resnet26,ea_resnet26}"
FAMILIES_224="${GPU_SESSION_FAMILIES_224:-resnet26,san10_pairwise,san10_patchwise}"
BUDGET_S="${GPU_SESSION_BUDGET_S:-480}"
DRY_RUN="${GPU_SESSION_DRY_RUN:-0}"
SKIP="${GPU_SESSION_SKIP:-}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
if [ "$DEVICE" = cuda ]; then GRAPHS=",cuda_graph,cuda_graph_reference"; else GRAPHS=""; fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/robust-attn-torch-ext}"
mkdir -p "$OUT"
LOG="$OUT/session.log"
STEPS="$OUT/steps.tsv"
: >"$LOG"
printf 'step\tstatus\texit_code\tseconds\n' >"$STEPS"

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$LOG"; }

# run_step NAME LIMIT_S COMMAND...: COMMAND under timeout, within what is left of the budget
run_step() {
    local name=$1 limit=$2 left start rc status
    shift 2
    left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [[ " $SKIP " == *" $name "* ]] || [ "$limit" -lt 15 ]; then
        log "step $name: skipped (GPU_SESSION_SKIP, or ${left} s of the budget left)"
        printf '%s\tskipped\t-\t0\n' "$name" >>"$STEPS"
        return
    fi
    log "step $name: start, limit ${limit} s: $*"
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" >>"$STEPS"
    log "step $name: $status (exit $rc, $((SECONDS - start)) s)"
}

# bench NAME LIMIT_S OPTIONS...: bench_efficiency.py on $DEVICE
bench() {
    local name=$1 limit=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then set -- "$@" --dry-run; fi
    run_step "$name" "$limit" "$PY" benchmarks/bench_efficiency.py --device "$DEVICE" "$@"
}

# what the machine is (a function run by `timeout` through bash, hence exported)
environment() {
    if [ "$DRY_RUN" != 1 ]; then
        nvidia-smi || echo "nvidia-smi: not available"
    fi
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available",
          torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
}
export -f environment
export PY DRY_RUN

log "gpu_session: device $DEVICE, python $PY, budget ${BUDGET_S} s, results in $OUT"
run_step env 30 bash -c environment
bench eff32 110 --sizes 32 --batch "$BATCH" --families "$FAMILIES" --repeats "$REPEATS" \
    --variants "default,reference,copy,bf16$GRAPHS" --out "$OUT/efficiency_$DEVICE.json"
bench eff224 130 --sizes "$SIZE_224" --width-224 "$WIDTH_224" --batch-224 "$BATCH_224" --families "$FAMILIES_224" \
    --repeats 5 --variants-224 "lean,reference,bf16$GRAPHS" --out "$OUT/efficiency_224_$DEVICE.json"
bench eff224-compiled 130 --sizes "$SIZE_224" --width-224 "$WIDTH_224" --batch-224 "$BATCH_224" \
    --families "$FAMILIES_224" --repeats 5 --variants-224 "lean,compiled_reference,compiled" \
    --out "$OUT/efficiency_224_compiled_$DEVICE.json"
if [ "$DRY_RUN" = 1 ]; then PYTEST_MODE=--collect-only; else PYTEST_MODE=-rs; fi
run_step pytest-cuda 60 "$PY" -m pytest tests/test_attack_step_paths.py tests/test_bench_efficiency.py -x \
    -k cuda "$PYTEST_MODE"
bench eff32-compiled 120 --sizes 32 --batch "$BATCH" --families "$FAMILIES" --repeats "$REPEATS" \
    --variants default,compiled --out "$OUT/efficiency_compiled_$DEVICE.json"

log "gpu_session: done in $SECONDS s"
column -t "$STEPS" 2>/dev/null || cat "$STEPS"
grep '^SUMMARY ' "$LOG" || true
# the script's exit status: 0 when every step ran to its end, 1 otherwise (steps.tsv says which)
awk -F '\t' 'NR > 1 && $2 != "ok" { bad = 1 } END { exit bad }' "$STEPS"
