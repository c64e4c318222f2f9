#!/usr/bin/env bash
# Every GPU check and figure in one command, for a GPU machine that gets a wheel and test
# executables built elsewhere: installs the wheel into a private folder, synthesises the
# Qwen3.6-35B-A3B artifact in the background while scripts/gpu_test.sh runs (kernel tests with
# their timings, the ninfer CUDA tests, pytest -m gpu), then runs scripts/gpu_bench.sh. Writes
# two logs, test.log and bench.log (plus the bench JSON), into OUT_DIR, and every test's own
# log packed as test-logs.tar.xz.
#
# Usage: scripts/gpu_all.sh WHEEL_DIR TEST_BIN_DIR OUT_DIR
#   WHEEL_DIR     holds one ninfer wheel built with `--features cuda`
#   TEST_BIN_DIR  the test executables for scripts/gpu_test.sh
# scripts/gpu_bin.sh DIR builds both (DIR and DIR/tests).
set -uo pipefail
[ $# -eq 3 ] || { sed -n '2,11p' "$0"; exit 2; }
wheels=$1 bins=$2 out=$3
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-deps --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH=$site
model="${TMPDIR:-/tmp}/ninfer-q36.ninfer"
synth_log=$(mktemp)
if [ ! -f "$model" ]; then
    python3 -m ninfer.cli synth --preset qwen3.6-35b-a3b -o "$model" > "$synth_log" 2>&1 &
fi
logs=$(mktemp -d)
"$root/scripts/gpu_test.sh" --bench --logs "$logs" "$bins" > "$out/test.log" 2>&1
echo "gpu_test.sh exit $?" >> "$out/test.log"
# The failing tests' own words up front (every test's whole log is in test-logs.tar.xz).
for f in $(grep -l "panicked\|^FAILED\|Error" "$logs"/*.log 2>/dev/null); do
    echo "-- $(basename "$f")"
    grep -E "panicked|^E |^FAILED|assert" "$f" | head -n 12
done >> "$out/test.log"
tar -cJf "$out/test-logs.tar.xz" -C "$logs" .
wait
tr '\r' '\n' < "$synth_log" | tail -n 1 >> "$out/test.log"
"$root/scripts/gpu_bench.sh" --model "$model" --log "$out/bench.log" --reps 2
