#!/usr/bin/env bash
# Whether a change is faster: two or more builds of ninfer on the same GPU and the same
# synthetic model, in turn. Installs each side into a folder of its own, synthesises the
# Qwen3.6-35B-A3B artifact once, then runs `ninfer bench` (pp512, tg128 at 1, 4 and 16
# sequences) and scripts/decode_trace.py for A, B, C, ..., A, B, C, ..., so that drift of the
# machine shows as the spread within each side rather than as a difference between them.
# Writes ab.log (every output, then a table of the medians with each side over A, and one of
# each kernel's charged µs per decode step against A) and each round's bench JSON into OUT_DIR.
#
# Usage: scripts/gpu_ab.sh OUT_DIR SIDE_A SIDE_B [SIDE ...] [ROUNDS]   (ROUNDS default 2)
# A side is a wheel with the CUDA backend (`maturin build --release --features cuda --out DIR`
# in a checkout of that side, a git worktree for another branch), or the core library of a
# build (its _core.abi3.so, optionally xz-compressed as _core.abi3.so.xz, as
# scripts/ab_cores.sh builds them) beside A's Python files, or this checkout's python/ninfer
# when A is a core: a build whose Python files match travels in a fifth of a wheel's bytes.
# NINFER_AB_CONCURRENCY (default 1,4,16) picks the tg128 figures and NINFER_AB_PREFILL (default
# 512) the prompt figures; bench sizes its engine by the longest prompt, so 16384 measures
# decode in an engine sized as `ninfer bench`'s defaults size it (longer graph KV buckets). A
# side whose bench fails or runs past NINFER_AB_TIMEOUT seconds (default 300) is reported and
# left out of the tables.
set -uo pipefail
args=("$@")
rounds=2
if [ $# -ge 1 ] && [[ ${args[-1]} =~ ^[0-9]+$ ]]; then
    rounds=${args[-1]}
    unset 'args[-1]'
fi
[ ${#args[@]} -ge 3 ] || { sed -n '2,20p' "$0"; exit 2; }
out=${args[0]}
sources=("${args[@]:1}")
[ ${#sources[@]} -le 26 ] || { echo "at most 26 sides" >&2; exit 2; }
conc=${NINFER_AB_CONCURRENCY:-1,4,16}
prefill=${NINFER_AB_PREFILL:-512}
limit=${NINFER_AB_TIMEOUT:-300}  # seconds a bench or a trace may run: a hung build loses its side, not the run
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
log="$out/ab.log"
: > "$log"
sides=()
declare -A site
for i in "${!sources[@]}"; do
    side=$(printf "\\x$(printf %x $((65 + i)))")
    src=${sources[$i]}
    sides+=("$side")
    site[$side]=$(mktemp -d)
    case $src in
    *.whl)
        python3 -m pip install -q --no-deps --target "${site[$side]}" "$src" || exit 1 ;;
    *_core.abi3.so | *_core.abi3.so.xz)
        if [ "$i" -eq 0 ]; then
            cp -r "$root/python/ninfer" "${site[$side]}/" || exit 1
        else
            cp -r "${site[A]}/." "${site[$side]}" || exit 1
        fi
        if [[ $src == *.xz ]]; then
            xz -dc "$src" > "${site[$side]}/ninfer/_core.abi3.so" || exit 1
        else
            cp "$src" "${site[$side]}/ninfer/_core.abi3.so" || exit 1
        fi ;;
    *)
        echo "not a wheel or a _core.abi3.so[.xz]: $src" >&2; exit 2 ;;
    esac
    echo "$side: $src" >> "$log"
done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } >> "$log" 2>&1
model="${TMPDIR:-/tmp}/ninfer-q36.ninfer"
traces=$(mktemp -d)  # the traces' JSON, summed up in ab.log (a GPU call returns few files)
if [ ! -f "$model" ]; then
    PYTHONPATH=${site[A]} python3 -m ninfer.cli synth --preset qwen3.6-35b-a3b -o "$model" >> "$log" 2>&1 || exit 1
fi
# The traces run in an engine of the bench's size, whose decode graph's KV bucket is the one
# bench times.
ctx=$(PYTHONPATH=${site[A]} python3 -c 'import sys; from ninfer.bench import engine_context
print(engine_context(tuple(int(x) for x in sys.argv[1].split(","))))' "$prefill") || exit 1
for r in $(seq 1 "$rounds"); do
    for side in "${sides[@]}"; do
        echo "== round $r, $side" | tee -a "$log"
        json="$out/bench-$side$r.json"
        PYTHONPATH=${site[$side]} timeout "$limit" python3 -m ninfer.cli bench "$model" --device cuda --reps 2 --prefill "$prefill" \
            --concurrency "$conc" --json > "$json" 2>> "$log" || echo "$side: bench exit $?" >> "$log"
        cat "$json" >> "$log"
        if python3 -c "import torch" 2>/dev/null; then
            PYTHONPATH=${site[$side]} timeout "$limit" python3 "$root/scripts/decode_trace.py" "$model" --max-context "$ctx" --json "$traces/$side$r.json" 2>&1 \
                | grep -v Warning >> "$log"
        fi
    done
done
python3 - "$out" "$rounds" "$traces" "${sides[@]}" <<'EOF' | tee -a "$log"
import json, os, statistics, sys
out, rounds, traces, sides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]


def bench(side, r):
    try:
        with open(f"{out}/bench-{side}{r}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# A side whose bench failed in any round (its error is in the log above) leaves the tables.
runs = {s: [bench(s, r) for r in range(1, rounds + 1)] for s in sides}
for s in sides:
    if None in runs[s]:
        print(f"side {s}: bench failed (see above)")
if None in runs["A"]:
    sys.exit(1)
sides = [s for s in sides if None not in runs[s]]
others = sides[1:]
names = [f["name"] for f in runs["A"][0]["figures"]]
print(f"{'figure':<12} " + " ".join(f"{s + ' (each round)':>24}" for s in sides) + " " + " ".join(f"{s + ' / A':>7}" for s in others))
for n in names:
    v = {s: [next(f["median"] for f in run["figures"] if f["name"] == n) for run in runs[s]] for s in sides}
    cells = " ".join(f"{' '.join(f'{x:,.1f}' for x in v[s]):>24}" for s in sides)
    ratios = " ".join(f"{statistics.median(v[s]) / statistics.median(v['A']):>7.3f}" for s in others)
    print(f"{n:<12} {cells} {ratios}")
# Each kernel's charged µs per decode step (decode_trace.py), the median of the rounds.
tr = {s: [json.load(open(p)) for r in range(1, rounds + 1) if os.path.isfile(p := f"{traces}/{s}{r}.json")] for s in sides}
if all(tr[s] for s in sides):
    def med(side, name):
        return statistics.median(next((k["charged_us"] for k in t["kernels"] if k["name"] == name), 0.0) for t in tr[side])
    names = list(dict.fromkeys(k["name"] for s in sides for t in tr[s] for k in t["kernels"]))
    names.sort(key=lambda n: -max(med(s, n) for s in sides))
    head = " ".join(f"{s:>9}" for s in sides) + " " + " ".join(f"{s + ' - A':>9}" for s in others)
    print(f"\n{'kernel (charged µs per step)':<40} {head}")
    def row(label, vals):
        print(f"{label:<40} " + " ".join(f"{vals[s]:>9.1f}" for s in sides) + " "
              + " ".join(f"{vals[s] - vals['A']:>+9.1f}" for s in others))
    for n in names:
        row(n, {s: med(s, n) for s in sides})
    row("step on the GPU", {s: statistics.median(t["step_us"] for t in tr[s]) for s in sides})
    # A kernel launched behind more than one other kernel, its charges by the one ahead.
    keys = list(dict.fromkeys((p["name"], p["after"]) for s in sides for t in tr[s] for p in t.get("pairs", [])))
    multi = [k for k in keys if sum(1 for m, _ in keys if m == k[0]) > 1]
    def pmed(side, key):
        return statistics.median(next((p["launches"] * p["charged_us_per_launch"] for p in t.get("pairs", [])
                                       if (p["name"], p["after"]) == key), 0.0) for t in tr[side])
    if multi:
        print(f"\n{'kernel < the kernel ahead (charged µs per step)':<72} {head}")
        for key in sorted(multi):
            vals = {s: pmed(s, key) for s in sides}
            label = " < ".join(n.removeprefix("ninfer_") for n in key)
            print(f"{label:<72} " + " ".join(f"{vals[s]:>9.1f}" for s in sides) + " "
                  + " ".join(f"{vals[s] - vals['A']:>+9.1f}" for s in others))
EOF
