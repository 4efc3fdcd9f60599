"""Mixed precision: bfloat16 models give float32 statistics; float64 stays float64."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef


STRUCTURES = [ef.KFAC(), ef.EKFAC(), ef.Diagonal(), ef.BlockDiagonal(), ef.Dense()]


def _setup(dtype):
    model = eqx.nn.MLP(
        4, 3, 8, 1, activation=jnp.tanh, key=jax.random.key(0), dtype=dtype
    )
    x = jax.random.normal(jax.random.key(1), (16, 4)).astype(dtype)
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize(
    "dtype, expected",
    [
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32),
        (jnp.float64, jnp.float64),
    ],
)
def test_statistics_dtype(structure, dtype, expected):
    model, batch = _setup(dtype)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    for block in curv.blocks.values():
        for leaf in jax.tree_util.tree_leaves(block):
            assert leaf.dtype == expected
    # Products and the diagonal come back in the parameters' dtype.
    params = eqx.filter(model, eqx.is_inexact_array)
    for out in (curv.solve(params, 1e-2), curv.mv(params), curv.diagonal()):
        for leaf in jax.tree_util.tree_leaves(out):
            assert leaf.dtype == dtype


def test_bfloat16_statistics_are_close_to_float32():
    m16, b16 = _setup(jnp.bfloat16)
    m32 = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, m16
    )
    b32 = (b16[0].astype(jnp.float32), b16[1])
    c16, c32 = (
        ef.curvature(loss_fn, m, b, estimator=ef.GGN(), structure=ef.KFAC()).as_matrix()
        for m, b in ((m16, b16), (m32, b32))
    )
    assert float(jnp.max(jnp.abs(c16 - c32)) / jnp.max(jnp.abs(c32))) < 0.05
    np.testing.assert_array_equal(np.asarray(c16).shape, np.asarray(c32).shape)
