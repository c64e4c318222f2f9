#!/usr/bin/env bash
# The test command: sets up .venv, builds ninfer, runs the Rust tests and the Python tests.
# GPU tests are marked and skipped here; scripts/gpu_test.sh runs them on a machine with a GPU.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
echo "== cargo test"
cargo test --workspace
echo "== pytest"
python -m pytest -q -m "not gpu" tests "$@"
