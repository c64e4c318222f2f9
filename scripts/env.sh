# Sourced by the scripts in this folder: a project virtualenv at .venv with the build and test
# tools, and the ninfer package built from this checkout into it (editable, release build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "== creating $ROOT/.venv"
  "$PY" -m venv "$ROOT/.venv"
fi
export VIRTUAL_ENV="$ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
echo "== installing build and test tools"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "maturin>=1.7,<2" "pytest>=8" numpy safetensors jinja2 aiohttp "openai>=1.40" "anthropic>=0.40"
echo "== building ninfer (release)"
(cd "$ROOT" && maturin develop --release --quiet)
