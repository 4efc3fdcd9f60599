#!/usr/bin/env bash
# The test suite's numerics on a CUDA GPU (run through the device tool, not in CI):
# float32 solves and log-determinants, curvature against float64 references, the
# optimiser. The GPU image has jax, equinox, lineax, optax, jaxtyping and pytest;
# beartype travels as a wheel in .whl/ (see the device tool's README).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
python3 -c "import jax, equinox, lineax, optax; print('jax', jax.__version__, jax.devices())"
python3 -m pytest -q -p no:cacheprovider -n 8 "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
