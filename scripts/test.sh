#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest; `scripts/test.sh -m slow` runs the
# tests that use the real embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (ruff's rules are in pyproject.toml); the layer order of relex's imports is tests/test_layers.py
.venv/bin/ruff check --quiet relex tests scripts analysis
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
exec .venv/bin/python -m pytest -q "$@"
