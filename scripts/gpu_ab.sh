#!/usr/bin/env bash
# Whether a change is faster: two builds of ninfer on the same GPU and the same synthetic model,
# in turn. Installs each wheel into a folder of its own, synthesises the Qwen3.6-35B-A3B artifact
# once, then runs `ninfer bench` (pp512, tg128 at 1, 4 and 16 sequences) and
# scripts/decode_trace.py for A, B, A, B, ..., so that drift of the machine shows as the spread
# within each side rather than as a difference between them. Writes ab.log (every output, then
# a table of the medians with B / A, and one of each kernel's charged µs per decode step, A
# against B) and each round's bench JSON into OUT_DIR.
#
# Usage: scripts/gpu_ab.sh OUT_DIR WHEEL_A WHEEL_B [ROUNDS]   (ROUNDS default 2)
# A wheel with the CUDA backend: `maturin build --release --features cuda --out DIR` in a
# checkout of each side (a git worktree for the other branch).
set -uo pipefail
[ $# -ge 3 ] || { sed -n '2,11p' "$0"; exit 2; }
out=$1 rounds=${4:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
log="$out/ab.log"
: > "$log"
declare -A wheel=([A]=$2 [B]=$3) site
for side in A B; do
    site[$side]=$(mktemp -d)
    python3 -m pip install -q --no-deps --target "${site[$side]}" "${wheel[$side]}" || exit 1
    echo "$side: $(basename "${wheel[$side]}")" >> "$log"
done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } >> "$log" 2>&1
model="${TMPDIR:-/tmp}/ninfer-q36.ninfer"
traces=$(mktemp -d)  # the traces' JSON, summed up in ab.log (a GPU call returns few files)
if [ ! -f "$model" ]; then
    PYTHONPATH=${site[A]} python3 -m ninfer.cli synth --preset qwen3.6-35b-a3b -o "$model" >> "$log" 2>&1 || exit 1
fi
for r in $(seq 1 "$rounds"); do
    for side in A B; do
        echo "== round $r, $side" | tee -a "$log"
        json="$out/bench-$side$r.json"
        PYTHONPATH=${site[$side]} python3 -m ninfer.cli bench "$model" --device cuda --reps 2 --prefill 512 \
            --concurrency 1,4,16 --json > "$json" 2>> "$log"
        cat "$json" >> "$log"
        if python3 -c "import torch" 2>/dev/null; then
            PYTHONPATH=${site[$side]} python3 "$root/scripts/decode_trace.py" "$model" --json "$traces/$side$r.json" 2>&1 \
                | grep -v Warning >> "$log"
        fi
    done
done
python3 - "$out" "$rounds" "$traces" <<'EOF' | tee -a "$log"
import json, os, statistics, sys
out, rounds, traces = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {s: [json.load(open(f"{out}/bench-{s}{r}.json")) for r in range(1, rounds + 1)] for s in "AB"}
names = [f["name"] for f in runs["A"][0]["figures"]]
print(f"{'figure':<12} {'A (each round)':>26} {'B (each round)':>26} {'B / A':>7}")
for n in names:
    v = {s: [next(f["median"] for f in run["figures"] if f["name"] == n) for run in runs[s]] for s in "AB"}
    cell = {s: " ".join(f"{x:,.1f}" for x in v[s]) for s in "AB"}
    ratio = statistics.median(v["B"]) / statistics.median(v["A"])
    print(f"{n:<12} {cell['A']:>26} {cell['B']:>26} {ratio:>7.3f}")
# Each kernel's charged µs per decode step (decode_trace.py), the median of the rounds.
tr = {s: [json.load(open(p)) for r in range(1, rounds + 1) if os.path.isfile(p := f"{traces}/{s}{r}.json")] for s in "AB"}
if tr["A"] and tr["B"]:
    def med(side, name):
        return statistics.median(next((k["charged_us"] for k in t["kernels"] if k["name"] == name), 0.0) for t in tr[side])
    names = list(dict.fromkeys(k["name"] for s in "AB" for t in tr[s] for k in t["kernels"]))
    names.sort(key=lambda n: -max(med("A", n), med("B", n)))
    print(f"\n{'kernel (charged µs per step)':<40} {'A':>9} {'B':>9} {'B - A':>9}")
    for n in names:
        a, b = med("A", n), med("B", n)
        print(f"{n:<40} {a:>9.1f} {b:>9.1f} {b - a:>+9.1f}")
    a, b = (statistics.median(t["step_us"] for t in tr[s]) for s in "AB")
    print(f"{'step on the GPU':<40} {a:>9.1f} {b:>9.1f} {b - a:>+9.1f}")
EOF
