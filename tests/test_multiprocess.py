"""Two JAX processes on one machine (`jax.distributed`, CPU collectives over gloo),
two CPU devices each, a batch sharded over all four: curvature,
`value_grad_and_curvature` and K-FAC optimiser steps equal those of one process on
one device (float64). The processes run `multiprocess_worker.py`."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from .multiprocess_worker import compute, problem


WORKER = Path(__file__).with_name("multiprocess_worker.py")
PROCESSES = 2
# A hung collective fails the test inside two minutes; a slower machine can allow
# more time with this environment variable.
TIMEOUT_S = float(os.environ.get("EQFISHER_MULTIPROCESS_TIMEOUT", 100))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The worker sets its own device count (`jax_num_cpu_devices`); a forced count
    # inherited from the environment (`XLA_FLAGS`) would conflict.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


class _Cluster:
    """The worker processes, started at once; `results()` waits for them."""

    def __init__(self, directory: Path):
        port = _free_port()
        self.paths = [directory / f"process{i}.npz" for i in range(PROCESSES)]
        self.logs = [
            open(directory / f"process{i}.log", "w+") for i in range(PROCESSES)
        ]
        self.deadline = time.monotonic() + TIMEOUT_S
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    str(i),
                    str(PROCESSES),
                    str(port),
                    str(p),
                ],
                env=_environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for i, (p, log) in enumerate(zip(self.paths, self.logs))
        ]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def results(self) -> list[dict[str, np.ndarray]]:
        try:
            for proc in self.procs:
                proc.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.stop()
        report = []
        for i, (proc, log) in enumerate(zip(self.procs, self.logs)):
            log.seek(0)
            text = log.read()[-4000:]
            report.append(f"--- process {i}, exit code {proc.returncode} ---\n{text}")
            log.close()
        if any(proc.returncode != 0 for proc in self.procs):
            pytest.fail(
                f"the {PROCESSES}-process run failed or took over {TIMEOUT_S} s:\n"
                + "\n".join(report)
            )
        return [dict(np.load(p)) for p in self.paths]


RESULTS = (
    "kfac_ggn",
    "dense_ggn",
    "blockdiag_fisher",
    "vgc_loss",
    "vgc_grads",
    "vgc_curvature",
    "kfac_losses",
    "kfac_params",
    "kfac_state",
)


# One test, not one per result: under pytest-xdist, tests of one module can land on
# different workers, and each would start its own cluster.
def test_two_processes_equal_one(tmp_path):
    from .helpers import dense_ggn_cross_entropy

    cluster = _Cluster(tmp_path)
    try:
        single = compute(*problem())  # while the workers run
    except BaseException:
        cluster.stop()
        raise
    distributed = cluster.results()

    for out in distributed:
        assert int(out["process_count"]) == PROCESSES
        assert int(out["global_devices"]) == 2 * PROCESSES
    mismatched = []
    for name in RESULTS:
        ref = single[name]
        assert ref.size > 0 and np.all(np.isfinite(ref)), name
        for i, out in enumerate(distributed):
            assert out[name].shape == ref.shape, (name, i)
            # Only the summation order differs (per-device partial sums, reduced).
            if not np.allclose(out[name], ref, rtol=1e-10, atol=1e-12):
                err = np.max(np.abs(out[name] - ref)) / np.max(np.abs(ref))
                mismatched.append(f"{name} (process {i}): relative error {err:.2e}")
    assert not mismatched, "\n".join(mismatched)

    # The one-process side is itself right: Dense GGN against `jax.jacfwd`.
    model, (x, y) = problem()
    ref = dense_ggn_cross_entropy(model, x, y)
    np.testing.assert_allclose(single["dense_ggn"], ref.ravel(), rtol=1e-10, atol=1e-12)
