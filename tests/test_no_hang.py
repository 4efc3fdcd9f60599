"""The programs that hung in jaxlib 0.10's batched LAPACK kernels return.

`hang_worker.py` runs a scanned GPT's `kfac_step` (inverses refreshed at every step)
and XTrace vmapped over 200 keys, ten times each, in a fresh process; a deadlock
never returns and fails the test at the timeout. Without eqfisher's one-matrix-at-a-
time factorisations (`hang_worker.py --plain`) the same process hangs on jaxlib 0.10
with 2 cores. Other jaxlibs have no such kernel path (`_compat.LAPACK_SPLITS_BATCHES`).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eqfisher import _compat


WORKER = Path(__file__).with_name("hang_worker.py")
# About a minute on 2 cores; a slower machine can allow more with this variable.
TIMEOUT_S = float(os.environ.get("EQFISHER_HANG_TIMEOUT", 300))


@pytest.mark.skipif(
    not _compat.LAPACK_SPLITS_BATCHES,
    reason="this jaxlib's LAPACK kernels do not split batches over the thread pool",
)
def test_kfac_step_and_vmapped_xtrace_return():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), "--repeats", "10"],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hang_worker.py did not return in {TIMEOUT_S} s: {e.stdout}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kfac_step x10" in done.stdout and "XTrace over 200 keys x10" in done.stdout
