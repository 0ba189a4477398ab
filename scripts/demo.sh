#!/usr/bin/env bash
# Run the demo on the embedded SmolLM2-135M (sets up .venv first). Extra arguments go to `relex demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/relex demo "$@"
