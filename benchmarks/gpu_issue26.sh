#!/usr/bin/env bash
# Issue 26, item 5, on a CUDA GPU (run through the device tool, not in CI): the
# scanned GPT's statistics and kfac_step against a gradient and an Adam step
# (benchmarks/gpu_gpt.py), then, when kfac_jax and scikit-learn can be imported,
# time to target against kfac_jax (benchmarks/kfac_vs_kfac_jax.py). The GPU image
# has jax, equinox, lineax, optax and jaxtyping; other packages travel as wheels in
# .whl/ (see benchmarks/gpu_check.sh and the device tool's README).
set -uo pipefail
out="${OUT:-/tmp}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
python3 benchmarks/gpu_gpt.py "$@" 2>&1 | tee "$out/gpu_gpt.txt"
if python3 -c "import kfac_jax, sklearn" 2> /dev/null; then
    python3 benchmarks/kfac_vs_kfac_jax.py --kfac-jax-grid best 2>&1 \
        | tee "$out/gpu_kfac_jax.txt"
else
    echo "kfac_jax or scikit-learn is not importable: carry their wheels in .whl/" \
        | tee "$out/gpu_kfac_jax.txt"
fi
