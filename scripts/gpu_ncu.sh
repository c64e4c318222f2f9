#!/usr/bin/env bash
# What limits a decode step's kernels, by Nsight Compute: runs `ninfer bench`'s tg128 at one
# sequence (or C) under `ncu`, the decode graph's kernels profiled as nodes, for the kernels
# whose names match REGEX: skips the first SKIP launches that match (a prompt pass runs other
# kernels, so those are the warm-up's decode steps) and profiles COUNT. Writes OUT_DIR/ncu.txt
# (each launch's throughput, launch, occupancy, scheduler, warp-state and memory sections),
# OUT_DIR/ncu.csv (the same as raw metrics) and OUT_DIR/ncu-summary.txt (scripts/ncu_summary.py:
# per kernel its duration, instructions, issue use, DRAM throughput and longest stalls, also
# printed). ncu replays every profiled launch alone at the clocks it finds (--clock-control
# none): no launch overlaps the one ahead as in the step, so durations read longer than the
# step's charges (scripts/decode_trace.py).
#
# Usage: scripts/gpu_ncu.sh MODEL OUT_DIR REGEX [SKIP] [COUNT] [CONCURRENCY]
#   REGEX  kernel names, e.g. 'ninfer_moe_(gate_up|down)_nvfp4'; SKIP default 40, COUNT 8
# Needs ninfer importable (PYTHONPATH) with the CUDA backend, and ncu on PATH or in
# /usr/local/cuda*/bin.
set -uo pipefail
[ $# -ge 3 ] || { sed -n '2,16p' "$0"; exit 2; }
model=$1 out=$2 regex=$3 skip=${4:-40} count=${5:-8} conc=${6:-1}
ncu=$(command -v ncu || ls -d /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
[ -n "$ncu" ] || { echo "ncu not found" >&2; exit 1; }
mkdir -p "$out"
sections=(SpeedOfLight LaunchStats Occupancy SchedulerStats WarpStateStats MemoryWorkloadAnalysis)
"$ncu" --graph-profiling node --clock-control none -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    "${sections[@]/#/--section=}" -o "$out/ncu" -f \
    python3 -m ninfer.cli bench "$model" --device cuda --reps 1 --prefill 512 --concurrency "$conc" > "$out/ncu-run.log" 2>&1
echo "ncu exit $?" >> "$out/ncu-run.log"
"$ncu" --import "$out/ncu.ncu-rep" --page details > "$out/ncu.txt" 2>&1
"$ncu" --import "$out/ncu.ncu-rep" --page raw --csv > "$out/ncu.csv" 2>&1
rm -f "$out/ncu.ncu-rep"
tail -n 3 "$out/ncu-run.log"
python3 "$(dirname "$0")/ncu_summary.py" "$out/ncu.csv" | tee "$out/ncu-summary.txt"
