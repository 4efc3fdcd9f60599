"""eqfisher against an independent implementation: dense matrices from curvlinops.

`tests/data/*.npz` hold a batch, the parameters (PyTorch order, which is the
`ravel_pytree` order of the matching Equinox model) and the GGN, K-FAC and EKFAC
("expand") matrices computed by curvlinops 3.0.1 in float64.
"""

import dataclasses
import functools as ft
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef


DATA = pathlib.Path(__file__).parent / "data"
F64 = jnp.float64


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, dtype=F64, key=k1)
        self.head = eqx.nn.Linear(18, 3, dtype=F64, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.conv(x)).reshape(-1))


def _ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _mse(model, batch):
    x, y = batch
    return ef.squared_error(jax.vmap(model)(x), y)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], Any]


CASES = {
    "mlp_tanh_ce": Case(
        "mlp_tanh_ce",
        lambda k: eqx.nn.MLP(4, 3, 6, 1, activation=jnp.tanh, dtype=F64, key=k),
        _ce,
    ),
    "mlp_tanh_mse": Case(
        "mlp_tanh_mse",
        lambda k: eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, dtype=F64, key=k),
        _mse,
    ),
    "cnn_tanh_ce": Case("cnn_tanh_ce", CNN, _ce),
}

# structure -> the curvlinops matrix it must reproduce
STRUCTURES = {
    "dense": (ef.Dense(), "ggn"),
    "kfac": (ef.KFAC(), "kfac_expand"),
    "ekfac": (ef.EKFAC(), "ekfac_expand"),
}


def load(name: str):
    """`(model, batch, data)`: the Equinox model with the stored parameters."""
    data = np.load(DATA / f"{name}.npz")
    case = CASES[name]
    model = case.model(jr.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    stored = [np.asarray(data[f"param{i}"]) for i in range(len(leaves))]
    stored = [s.reshape(leaf.shape) for s, leaf in zip(stored, leaves, strict=True)]
    assert all(s.dtype == np.float64 for s in stored)
    params = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(s) for s in stored])
    model = eqx.combine(params, static)
    batch = (jnp.asarray(data["X"]), jnp.asarray(data["y"]))
    return model, batch, data


@ft.cache
def results(name: str) -> dict[str, Any]:
    """eqfisher's matrices for one case, from one compilation (`eqx.filter_jit`)."""
    model, batch, _ = load(name)
    loss_fn = CASES[name].loss_fn

    @eqx.filter_jit
    def run(model, batch):
        out = {
            structure: ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=struct
            ).as_matrix()
            for structure, (struct, _) in STRUCTURES.items()
        }
        out["fisher_exact"] = ef.curvature(
            loss_fn, model, batch, estimator=ef.FisherExact(), structure=ef.Dense()
        ).as_matrix()
        out["ggn_operator"] = ef.ggn_operator(loss_fn, model, batch).as_matrix()
        return out

    return run(model, batch)


def assert_close(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, what
    scale = np.max(np.abs(expected))
    np.testing.assert_allclose(
        actual, expected, rtol=0, atol=1e-11 * scale, err_msg=what
    )


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_round_trip(name):
    model, batch, data = load(name)
    flat, _ = jax.flatten_util.ravel_pytree(eqx.filter(model, eqx.is_inexact_array))
    expected = np.concatenate([np.ravel(data[f"param{i}"]) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(flat), expected)
    assert flat.size == data["ggn"].shape[0]


# One test per case checks every matrix of `results(name)`: tests of one module are
# dealt to pytest-xdist's workers in turn, and each worker would compile its own.
@pytest.mark.parametrize("name", list(CASES))
def test_curvature_matches_curvlinops(name):
    _, _, data = load(name)
    out = results(name)
    for structure, (_, matrix) in STRUCTURES.items():
        assert_close(out[structure], data[matrix], structure)
    assert_close(out["ggn_operator"], data["ggn"], "ggn_operator")
    # FisherExact is the GGN: the registered losses are exponential families in
    # their natural parameters.
    assert_close(out["fisher_exact"], data["ggn"], "fisher_exact")


def test_kfac_reduce_matches_curvlinops():
    # Only the CNN shares weights (over conv patches); for its conv layer "reduce"
    # averages each example's patches and sums its output cotangents.
    model, batch, data = load("cnn_tanh_ce")
    curv = eqx.filter_jit(
        lambda m, b: ef.curvature(
            CASES["cnn_tanh_ce"].loss_fn,
            m,
            b,
            estimator=ef.GGN(),
            structure=ef.KFAC(weight_sharing="reduce"),
        ).as_matrix()
    )(model, batch)
    assert_close(curv, data["kfac_reduce"])
    assert not np.allclose(data["kfac_reduce"], data["kfac_expand"])
