#!/usr/bin/env bash
# Builds what a GPU machine without Rust needs, into one folder for scripts/gpu_all.sh: the
# ninfer wheel with the CUDA backend (OUT_DIR/*.whl) and the stripped test executables of the
# kernels and of the CUDA backend (OUT_DIR/tests/). nvcc is found as build.rs finds it
# (scripts/install_nvcc.sh installs it). Release builds only: the folder stays near 37 MB, and
# OUT_DIR.tar.xz, the same packed (~15 MB), is what to copy when the copy's size is limited
# (`tar -xJf OUT_DIR.tar.xz` there gives OUT_DIR back). The tokenizer tests read fixtures by
# this checkout's absolute path, compiled in: build in a checkout at the path the GPU machine's
# copy of the repository has (a second worktree's binaries fail those six tests there).
#
# Usage: scripts/gpu_bin.sh OUT_DIR
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,11p' "$0"; exit 2; }
out=$1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
rm -rf "$out"
mkdir -p "$out/tests"
maturin build --release --features cuda --out "$out"
{
    cargo test --no-run --release -p ninfer-kernels --features build-cubins --message-format=json
    cargo test --no-run --release -p ninfer --features cuda --message-format=json
} 2>/dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    exe = m.get("executable")
    # the CPU-only example test is left out: it needs cargo at run time
    if m.get("reason") == "compiler-artifact" and exe and m["profile"]["test"] and "/example-" not in exe:
        print(exe)' | while read -r exe; do cp "$exe" "$out/tests/"; done
strip "$out"/tests/*
tar -cJf "$out.tar.xz" "$out"
du -sh "$out" "$out.tar.xz"
