#!/usr/bin/env bash
# Runs ninfer's GPU tests and prints a summary: every test of every test executable in a folder
# (the ninfer-kernels kernel tests, built with `cargo test --no-run --release -p ninfer-kernels
# --features build-cubins`, and the ninfer crate's tests with the CUDA backend, built with
# `cargo test --no-run --release -p ninfer --features cuda`), each test in its own process so
# that a sticky CUDA error (an illegal address, say) fails that test alone; then the Python
# tests marked `gpu` when pytest can import ninfer.
#
# Usage: scripts/gpu_test.sh [--bench] [--logs DIR] [BIN_DIR]
#   BIN_DIR   folder of test executables; without it the kernel tests are built first and
#             cargo's own executables are run.
#   --bench   also run the ignored timing tests (their lines start with BENCH).
#   --logs    keep each test's full output in DIR (default: a temporary folder).
# A test that runs past GPU_TEST_TIMEOUT seconds (default 300; the Python tests together get
# three times that) is killed and counted as failed (exit 124), so that a hung kernel costs one
# test, not the whole run. Exits non-zero when any test fails. CI has no GPU and does not run
# this.
set -uo pipefail

limit=${GPU_TEST_TIMEOUT:-300}
bench=0
logs=""
bin_dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bench) bench=1 ;;
        --logs) logs=$2; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) bin_dir=$1 ;;
    esac
    shift
done
root=$(cd "$(dirname "$0")/.." && pwd)
[ -n "$logs" ] || logs=$(mktemp -d)
mkdir -p "$logs"

bins=()
if [ -n "$bin_dir" ]; then
    for f in "$bin_dir"/*; do
        # test executables only: ELF files, not scripts or logs beside them
        [ -f "$f" ] && [ -x "$f" ] && [ "$(head -c 4 "$f" | od -An -c | tr -d " ")" = "177ELF" ] && bins+=("$f")
    done
else
    while IFS= read -r exe; do
        bins+=("$exe")
    done < <(cd "$root" && {
        cargo test --no-run --release -p ninfer-kernels --features build-cubins --message-format=json
        cargo test --no-run --release -p ninfer --features cuda --message-format=json
    } 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
fi
if [ ${#bins[@]} -eq 0 ]; then
    echo "no test executables found" >&2
    exit 2
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
    echo "nvidia-smi: not available"

failed=0
summary=()
failures=()
for exe in "${bins[@]}"; do
    bin=$(basename "$exe")
    mapfile -t tests < <("$exe" --list 2>/dev/null | sed -n 's/: test$//p')
    ignored=" $("$exe" --list --ignored 2>/dev/null | sed -n 's/: test$//p' | tr '\n' ' ') "
    pass=0
    fail=0
    start=$(date +%s)
    for t in "${tests[@]}"; do
        # ignored tests are the timing runs: only with --bench
        [ $bench -eq 0 ] && [[ "$ignored" == *" $t "* ]] && continue
        log="$logs/$bin.$t.log"
        timeout "$limit" "$exe" --exact "$t" --include-ignored --nocapture --test-threads=1 >"$log" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            pass=$((pass + 1))
        else
            fail=$((fail + 1))
            failures+=("$bin $t (exit $rc)")
            echo "FAILED $bin $t"
            grep -E 'panicked at|error|Error' -A2 "$log" | head -n 8
        fi
        # a test's first line follows cargo's "test NAME ... " on the same line
        grep -oE 'BENCH .*' "$log" || true
    done
    [ $fail -gt 0 ] && failed=1
    summary+=("$bin: $pass passed, $fail failed ($(( $(date +%s) - start )) s)")
done

pytest_line="pytest -m gpu: skipped (pytest or the ninfer package is not importable)"
if python3 -c 'import pytest, ninfer' 2>/dev/null && [ -d "$root/tests" ]; then
    # only the files that hold GPU tests: the others may import client libraries (openai,
    # anthropic) that a GPU machine need not have
    mapfile -t gpu_files < <(cd "$root" && grep -l 'pytest.mark.gpu' tests/*.py)
    (cd "$root" && timeout $((3 * limit)) python3 -m pytest -q -m gpu "${gpu_files[@]}") >"$logs/pytest-gpu.log" 2>&1
    rc=$?
    case $rc in
        0) pytest_line="pytest -m gpu: passed" ;;
        5) pytest_line="pytest -m gpu: no tests marked gpu" ;;
        *) pytest_line="pytest -m gpu: FAILED (exit $rc)"; failed=1 ;;
    esac
    tail -n 3 "$logs/pytest-gpu.log"
fi

echo
echo "== GPU test summary (logs in $logs) =="
for line in "${summary[@]}"; do
    echo "$line"
done
for line in "${failures[@]}"; do
    echo "failed: $line"
done
echo "$pytest_line"
exit $failed
