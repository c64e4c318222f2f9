#!/usr/bin/env bash
# The figures of docs/performance.md in one command, on a machine with an NVIDIA GPU and ninfer
# (built with the `cuda` feature) importable: the synthetic Qwen3.6-35B-A3B in the reference
# recipe, `ninfer bench` at the default figures, tg128 after a 32k-token prompt, the
# kernel-by-kernel profile of one decode step, and (where torch is installed) the CUPTI trace of
# the decode step as the engine runs it (scripts/decode_trace.py). Everything goes to one log
# (and JSON beside it).
#
# Usage: scripts/gpu_bench.sh [--model FILE] [--log FILE] [--reps N] [--skip-long]
#   --model  an artifact to measure (default: synthesised once into $TMPDIR/ninfer-q36.ninfer)
#   --log    where the log goes (default: ./gpu-bench.log; JSON files are written beside it)
set -uo pipefail

model=""
log="gpu-bench.log"
reps=3
long=1
while [ $# -gt 0 ]; do
    case "$1" in
        --model) model=$2; shift ;;
        --log) log=$2; shift ;;
        --reps) reps=$2; shift ;;
        --skip-long) long=0 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
ninfer=(python3 -m ninfer.cli)
base="${log%.log}"
: > "$log"
step() {
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$log"
    "$@" >> "$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; git rev-parse --short HEAD; date -u; } >> "$log" 2>&1
if [ -z "$model" ]; then
    model="${TMPDIR:-/tmp}/ninfer-q36.ninfer"
    [ -f "$model" ] || step synth "${ninfer[@]}" synth --preset qwen3.6-35b-a3b -o "$model"
fi
# The bench's JSON goes to its own file and into the log.
step bench sh -c '"$@" > "$0" && cat "$0"' "$base.bench.json" "${ninfer[@]}" bench "$model" --device cuda --reps "$reps" --json
step profile "${ninfer[@]}" bench "$model" --profile
if python3 -c "import torch" 2>/dev/null; then
    # In an engine of the bench's size (its default figures): the same KV bucket, so the same
    # decode graph, as its tg128.
    ctx=$(python3 -c 'from ninfer.bench import engine_context; print(engine_context())')
    step trace python3 "$(dirname "$0")/decode_trace.py" "$model" --pairs --max-context "$ctx" --json "$base.trace.json"
else
    echo "== trace: skipped (no torch for its profiler)" | tee -a "$log"
fi
if [ $long -eq 1 ]; then
    # tg128 after a 32k-token prompt (prefilled in the engine's chunks), and pp8192 beside it.
    step long "${ninfer[@]}" bench "$model" --device cuda --reps 1 --prefill 8192 --concurrency 1 --tg-prompt 32768
fi
echo "log: $log"
