#!/usr/bin/env bash
# The core library of each of several revisions, for scripts/gpu_ab.sh's sides after A: checks
# each REV out in a git worktree of its own (WORKTREE, created when missing, reused after: its
# target folder keeps the build incremental), builds the CUDA wheel there and keeps the wheel's
# ninfer/_core.abi3.so as OUT_DIR/<REV>_core.abi3.so.xz (about 3 MB, a fifth of the wheel).
# The revisions' Python files must match side A's wheel, which gpu_ab.sh installs beneath them.
# nvcc is found as build.rs finds it (scripts/install_nvcc.sh installs it).
#
# Usage: scripts/ab_cores.sh WORKTREE OUT_DIR REV [REV ...]
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,9p' "$0"; exit 2; }
tree=$1 out=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$tree" ] || git -C "$root" worktree add -q --detach "$tree"
whl=$(mktemp -d)
for rev in "$@"; do
    git -C "$tree" checkout -q --detach "$rev"
    rm -f "$whl"/*.whl
    (cd "$tree" && maturin build --release --features cuda --out "$whl" > "$whl/build.log" 2>&1) || { tail -n 20 "$whl/build.log"; exit 1; }
    name=$(echo "$rev" | tr '/' '_')
    unzip -p "$whl"/*.whl ninfer/_core.abi3.so | xz -6 -T2 > "$out/${name}_core.abi3.so.xz"
    echo "$rev $(git -C "$tree" rev-parse --short HEAD) $(stat -c %s "$out/${name}_core.abi3.so.xz") bytes"
done
