#!/usr/bin/env bash
# Stop a model's run at a point cheap to keep: right after it saves a state smaller than MAX_MB
# (a member or a checkpoint within one), or right after it finishes a radius. Kills the chain
# that runs it first (so that it starts no next model), then the study process. Saves are atomic,
# so stopping at any moment loses only the work since the last save; this loses almost none.
# Usage: bash reports/in-progress/stop_small.sh MODEL CHAIN_FIRST_MODEL [MAX_MB=20]
set -u
model=$1; chain=$2; max=$((${3:-20} * 1024 * 1024))
run=runs/study-fashion_mnist-aa4/autoattack-$model
state() { stat -c '%n %Y %s' "$run"/partial/*.pt 2>/dev/null; }
count() { find "$run/records" -name '*.csv' | wc -l; }
last=$(state); n=$(count)
while pgrep -f -- "--models $model " > /dev/null; do
  sleep 5
  now=$(state); m=$(count)
  size=$(echo "$now" | awk '{s += $3} END {print s + 0}')
  if [ "$m" -gt "$n" ] || { [ "$now" != "$last" ] && [ -n "$now" ] && [ "$size" -lt "$max" ]; }; then
    pkill -f "chain.sh $chain" ; pkill -f -- "--models $model "
    echo "$(date +%T) stopped $model (state: ${now:-none}; chunks $m)"
    exit 0
  fi
  last=$now
done
echo "$(date +%T) $model is not running"
