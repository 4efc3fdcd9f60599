"""The worked examples in `examples/`, each run in its smoke mode with a real check.

The examples are scripts, not a package: each is imported from its file. They need
scikit-learn (the digits data) except `vmc_harmonic` and `stop_gradient_views`.

They run with this suite's float64 default and strict rank promotion, but with
standard dtype promotion: optax's Adam computes `b1 ** count` (a Python float to an
int32 power), which strict promotion rejects.
"""

import importlib.util
import math
import pathlib

import jax
import numpy as np
import pytest


EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run(name: str, **kwargs) -> dict:
    spec = importlib.util.spec_from_file_location(
        f"eqfisher_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with jax.numpy_dtype_promotion("standard"):
        return module.main(smoke=True, **kwargs)


def test_every_example_is_tested():
    names = {p.stem for p in EXAMPLES.glob("*.py")}
    tested = {n.removeprefix("test_") for n in globals() if n.startswith("test_")}
    assert names <= tested, f"examples without a test: {sorted(names - tested)}"


def test_kfac_digits():
    r = run("kfac_digits")
    assert r["train_loss"] < 0.2
    assert r["train_accuracy"] > 0.95 and r["test_accuracy"] > 0.9
    assert r["curvature_ok"]


def test_laplace_digits():
    r = run("laplace_digits")
    for split in ("clean", "noisy"):
        for m in r[split].values():
            assert all(math.isfinite(m[k]) for k in ("accuracy", "nll", "ece"))
            assert 0 <= m["ece"] <= 1
    # The prior precisions maximise the marginal likelihood inside the grid.
    for name in ("Laplace K-FAC", "Laplace last layer"):
        assert 1e-3 < r["clean"][name]["prior_precision"] < 1e4
    # Under input noise the overconfident MAP model is beaten by both posteriors.
    for name in ("Laplace K-FAC", "Laplace last layer"):
        assert r["noisy"][name]["nll"] < 0.7 * r["noisy"]["MAP"]["nll"]
    # The last-layer posterior (probit) keeps the MAP model's clean accuracy.
    assert r["clean"]["Laplace last layer"]["accuracy"] >= (
        r["clean"]["MAP"]["accuracy"] - 0.02
    )
    # log det(N·C + δ·I) = P·log N + logdet(C, δ/N), against a dense slogdet. In
    # float32 both sides sum the logarithms of hundreds of eigenvalues, rounded
    # differently: 0.8e-5 and 1.7e-5 apart run alone (default and one BLAS
    # thread), 1.15e-4 once in CI's parallel run, where rel=1e-4 failed. A wrong
    # convention moves the sum by P·log N, thousands of times more.
    assert r["logdet_via_curvature"] == pytest.approx(r["logdet_direct"], rel=1e-3)


def test_ewc_split_digits():
    r = run("ewc_split_digits")
    assert r["task_A_before"] > 0.95
    # Plain fine-tuning forgets task A; EWC retains clearly more of it.
    assert r["EWC"]["task_A"] > r["fine-tuning"]["task_A"] + 0.05
    assert r["EWC"]["task_B"] > 0.85 and r["fine-tuning"]["task_B"] > 0.9


def test_vmc_harmonic():
    r = run("vmc_harmonic")
    assert abs(r["energy"] - 0.5) < 0.01
    assert abs(r["a"] - 0.5) < 0.01 and abs(r["b"]) < 0.01
    # The registered loss's GGN is the SR metric 4·mean(Õ Õᵀ).
    assert r["metric_error"] < 1e-4 * r["metric_scale"]


def test_stop_gradient_views():
    r = run("stop_gradient_views")
    assert r["gradient_error"] <= 1e-6 * r["gradient_scale"]
    assert r["scans_with_views"] == 1
    assert r["scans_one_by_one"] > 1
    assert r["final_loss"] < 0.9 * r["initial_loss"]


def test_influence():
    r = run("influence")
    assert r["solve_error"] < 1e-3
    scale = np.max(np.abs(r["influence_dense"]))
    np.testing.assert_allclose(
        r["influence"], r["influence_dense"], atol=1e-3 * scale, rtol=0
    )
    # The most helpful points lower the test loss, the most harmful raise it.
    assert r["influence"][r["helpful"][0]] < 0 < r["influence"][r["harmful"][0]]


def test_edge_of_stability(tmp_path):
    r = run("edge_of_stability", out=str(tmp_path / "eos.png"))
    assert (tmp_path / "eos.png").stat().st_size > 0
    assert r["losses"][-1] < 0.5 * r["losses"][0]
    assert np.all(np.asarray(r["hessian_top"]) > 0)
    assert np.all(np.isfinite(r["ggn_top"]))
    # Lanczos (20 products) against eigvalsh of the dense jax.hessian, float32.
    assert r["lanczos_top"] == pytest.approx(r["dense_top"], rel=1e-3)
