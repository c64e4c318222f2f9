#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/logs
t0=$(date +%s)
nvidia-smi | head -15 > "$OUT/nvidia-smi.txt" 2>&1
timeout 200 scripts/gpu_test.sh --logs /tmp/logs gpu-bin 2>&1 | tee "$OUT/summary.txt"
for f in /tmp/logs/*.log; do echo "=== $f"; cat "$f"; done > "$OUT/all.log"
echo "=== tests done at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
timeout 60 gpu-bin/kernels-gpu --ignored --nocapture --test-threads=1 > "$OUT/bench.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/summary.txt"
grep -E "^BENCH|panicked" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
echo "=== memcheck at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 gpu-bin/kernels-gpu --test-threads=1 \
  small_heads odd_group decode_split kv_write conv_continues recurrent_small sample_known \
  embed router rms_norm gated add_rms gemv_all_encodings_small expert_banks_all \
  > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $? at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
grep -E "ERROR SUMMARY|test result|Invalid|FAILED" "$OUT/memcheck.log" | head -20 | tee -a "$OUT/summary.txt"
