#!/usr/bin/env bash
# A study's attack steps on a lent GPU machine, as record chunks that the CPU study adopts
# (docs/gpu-runs.md, "Handing a study's attacks to a lent GPU").
#
# On the device (the device tool's command, from the repository root, timeout_s 600):
#
#     bash zoo/studies/gpu_attacks.sh
#
# Each model of MODELS runs `robust-attn study STUDY --protocols PROTOCOLS --models MODEL --device
# cuda --attention-path reference` in a process of its own (the attention layers are launch-bound on
# a GPU, so a few processes share one well), all together for BUDGET_S seconds; then each gets a
# SIGTERM (an attack saves its state and stops) and, 60 s later, a SIGKILL. Their runs folder comes
# back as $OUT/runs.tar.gz: every run's run.json and finished record chunks with their manifest
# entries (no claims, no saved attack states: those belong to the machine that wrote them), with
# each model's log in logs/. On the CPU machine, unpack it beside the study's runs and name it with
# --reuse-runs: the study adopts each finished chunk of the same computation, checksum verified, its
# manifest entry naming the GPU that computed it (docs/studies.md):
#
#     mkdir -p runs/gpu-efficient && tar -xzf FILES_AT/runs.tar.gz -C runs/gpu-efficient
#     robust-attn study zoo/studies/cifar10_efficient.toml --runs runs/study-cifar10-efficient \
#         --reuse-runs runs/gpu-efficient ...
#
# Python: $PYTHON, else .venv/bin/python where it exists, else python3 (the lent machines reach no
# package registry; their python3 has torch with CUDA, numpy, pandas, scipy and safetensors, which
# is what a study of the zoo's models imports). The repository goes on PYTHONPATH: no install step.
#
# What travels: the device tool sends the checkout, at most 64 MiB; the tracked files are about
# 164 MiB. A study of the zoo's CIFAR-10 models reads robust_attn/ (15 MiB, the embedded test sets
# included), zoo/ and the checkpoints of its models (about 3 MiB each: 21 MiB for the efficient
# zoo's seven, the same for the -adv ones), so for the call:
#
#     git sparse-checkout set --no-cone '/*' '!/reports/' '!/tests/' '!/zoo/checkpoints/' \
#         '/zoo/checkpoints/cifar10/*-efficient.*'        # or *-adv.* for the adversarial study
#     ... the device call ...
#     git sparse-checkout disable
#
# Settings (environment): STUDY (zoo/studies/cifar10_efficient.toml), MODELS (the config's labels,
# comma list; default the four whose AutoAttack at 2/255 the study's plan puts highest on the CPU:
# SASA 3.4 h, SAN10 pairwise 1.9 h, SAN10 patchwise 1.8 h, GSA 1.8 h; the adversarial study's
# AutoAttack at 8/255 is STUDY=zoo/studies/cifar10_adversarial.toml MODELS=aa_resnet26-adv,...),
# PROTOCOLS (autoattack),
# BUDGET_S (420), DEVICE (cuda), ATTENTION_PATH (reference), RUNS (a scratch folder), OUT
# (runs/gpu-attacks where the device tool sets none), EXTRA (more study options, e.g. for a smoke
# run on a CPU: DEVICE=cpu ATTENTION_PATH=lean EXTRA="--attack-limit 4 --autoattack-limit 4").
set -u -o pipefail
cd "$(dirname "$0")/../.."

STUDY="${STUDY:-zoo/studies/cifar10_efficient.toml}"
MODELS="${MODELS:-sasa_resnet26,san10_pairwise,san10_patchwise,gsa_resnet26}"
PROTOCOLS="${PROTOCOLS:-autoattack}"
BUDGET_S="${BUDGET_S:-420}"
DEVICE="${DEVICE:-cuda}"
ATTENTION_PATH="${ATTENTION_PATH:-reference}"
OUT="${OUT:-runs/gpu-attacks}"
RUNS="${RUNS:-$(mktemp -d)/runs}"
EXTRA="${EXTRA:-}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/robust-attn-torch-ext}"
mkdir -p "$OUT" "$RUNS/logs"
echo "gpu_attacks: $STUDY, models $MODELS, protocols $PROTOCOLS, $DEVICE ($ATTENTION_PATH paths), ${BUDGET_S} s"

IFS=, read -r -a models <<<"$MODELS"
for model in "${models[@]}"; do
    # shellcheck disable=SC2086  # EXTRA is a list of options
    timeout -s TERM -k 60 "$BUDGET_S" "$PY" -m robust_attn.cli study "$STUDY" --runs "$RUNS" \
        --out "$RUNS/../report-$model" --protocols "$PROTOCOLS" --models "$model" --device "$DEVICE" \
        --attention-path "$ATTENTION_PATH" --workers 1 --no-progress $EXTRA >"$RUNS/logs/$model.log" 2>&1 &
done
failed=0
for job in $(jobs -p); do
    wait "$job" || failed=$((failed + 1))
done
echo "gpu_attacks: the processes ended after $SECONDS s ($failed stopped by the budget or failing; logs/ says which)"

"$PY" -m robust_attn.cli status "$RUNS" 2>&1 | grep -v '^  to compute' || true
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude=claims --exclude=partial --exclude='*.lock' .
echo "gpu_attacks: $OUT/runs.tar.gz, $(du -k "$OUT/runs.tar.gz" | cut -f1) KiB"
