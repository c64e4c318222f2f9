#!/usr/bin/env bash
# Builds ninfer into .venv and serves the bundled demo model (or MODEL) on 127.0.0.1:8000.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec ninfer serve "$@"
