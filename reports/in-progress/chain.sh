#!/usr/bin/env bash
# Resume the Fashion-MNIST AutoAttack runs of the given models, one after another, on one thread.
# Usage (from the repository root): bash reports/in-progress/chain.sh MODEL [MODEL ...]
# Each model's run continues where its saved state left off (largest radius first); a finished
# run is skipped by the runner, and a model whose run is packed in reports/autoattack-fashion_mnist
# (finished, and moved there) is not started again. Logs go to /tmp/aa-fm-MODEL.log.
set -u
for m in "$@"; do
  if [ -d "reports/autoattack-fashion_mnist/runs/autoattack-$m" ]; then
    echo "$m: finished (packed in reports/autoattack-fashion_mnist/runs), skipped" >> "/tmp/aa-fm-$m.log"
    continue
  fi
  OMP_NUM_THREADS=1 .venv/bin/robust-attn study --dataset fashion_mnist --attack-limit 1000 \
    --attack-batch-size 1000 --autoattack-eps 1,2,4,8 --protocols autoattack --models "$m" \
    --workers 1 --runs runs/study-fashion_mnist-aa4 --out "/tmp/report-fm-$m" >> "/tmp/aa-fm-$m.log" 2>&1
done
