#!/usr/bin/env bash
# First run: builds ninfer into .venv and completes a prompt with the bundled demo model.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ninfer generate "def fibonacci(n):" --max-tokens 48 --seed 3
