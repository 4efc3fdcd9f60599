"""float32 and bfloat16 numerics: `solve` and `logdet` are finite for any positive
damping, and are backward stable against a dense float64 reference."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef

from .helpers import block_slices, dense_ggn_cross_entropy


STRUCTURES = [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal(), ef.KFAC(), ef.EKFAC()]
EPS32 = float(jnp.finfo(jnp.float32).eps)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _setup(dtype):
    model = eqx.nn.MLP(
        8, 3, 16, 2, activation=jnp.tanh, key=jax.random.key(0), dtype=dtype
    )
    x = jax.random.normal(jax.random.key(1), (64, 8)).astype(dtype)
    y = jax.random.randint(jax.random.key(2), (64,), 0, 3)
    return model, (x, y)


def _cast(tree, dtype):
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


def _reference(structure, model64, batch64) -> np.ndarray:
    """The float64 matrix the float32 curvature approximates: the GGN from
    `jax.jacfwd` restricted to the structure's pattern for the exact structures; the
    float64 curvature of the same structure for K-FAC and EKFAC (their definitions
    are checked against references in test_curvature.py)."""
    if isinstance(structure, ef.KFAC | ef.EKFAC):
        curv = ef.curvature(
            loss_fn, model64, batch64, estimator=ef.GGN(), structure=structure
        )
        return np.asarray(curv.as_matrix())
    ggn = dense_ggn_cross_entropy(model64, *batch64)
    if isinstance(structure, ef.Dense):
        return ggn
    if isinstance(structure, ef.Diagonal):
        return np.diag(np.diag(ggn))
    mask = np.zeros_like(ggn, dtype=bool)
    slices = block_slices(model64)
    for layer in range(len(slices) // 2):  # (weight, bias) of each Linear
        start, stop = slices[2 * layer].start, slices[2 * layer + 1].stop
        mask[start:stop, start:stop] = True
    return np.where(mask, ggn, 0.0)


# The reference depends on the structure only (not on the damping): computed once.
@ft.cache
def _reference_of(index: int) -> np.ndarray:
    """`_reference` of `STRUCTURES[index]` for the float32 problem cast to float64."""
    model, batch = _setup(jnp.float32)
    b = _reference(
        STRUCTURES[index], _cast(model, jnp.float64), _cast(batch, jnp.float64)
    )
    b.flags.writeable = False
    return b


@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("damping", [1e-2, 1e-8, 1e-12])
def test_float32_solve_is_finite_and_backward_stable(structure, damping):
    model, batch = _setup(jnp.float32)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    params = eqx.filter(model, eqx.is_inexact_array)
    vector = jax.tree_util.tree_map(lambda p: jnp.cos(3.0 * p), params)
    solution = curv.solve(vector, damping)
    x, _ = ravel_pytree(solution)
    v, _ = ravel_pytree(vector)
    assert x.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(x)))
    logdet = curv.logdet(damping)
    assert logdet.dtype == jnp.float32 and bool(jnp.isfinite(logdet))

    # Backward error: x solves (B + damping·I) x = v for a B within a few float32
    # roundings of the float64 curvature.
    b = _reference_of(next(i for i, s in enumerate(STRUCTURES) if s is structure))
    x64, v64 = np.asarray(x, np.float64), np.asarray(v, np.float64)
    residual = b @ x64 + damping * x64 - v64
    scale = np.linalg.norm(b, 2) * np.linalg.norm(x64) + np.linalg.norm(v64)
    assert np.linalg.norm(residual) <= 1e3 * EPS32 * scale

    if damping == 1e-2:  # well conditioned: forward accuracy, float32 level
        expected = np.linalg.solve(b + damping * np.eye(b.shape[0]), v64)
        np.testing.assert_allclose(x64, expected, rtol=1e-3, atol=1e-3)
        sign, expected_logdet = np.linalg.slogdet(b + damping * np.eye(b.shape[0]))
        assert sign == 1
        np.testing.assert_allclose(float(logdet), expected_logdet, rtol=1e-4)


@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: type(s).__name__)
def test_bfloat16_model_solve_and_logdet_are_finite(structure):
    model, batch = _setup(jnp.bfloat16)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    params = eqx.filter(model, eqx.is_inexact_array)
    for damping in (1e-8, 1e-12):
        leaves = jax.tree_util.tree_leaves(curv.solve(params, damping))
        assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)
        assert bool(jnp.isfinite(curv.logdet(damping)))


def test_full_block_falls_back_when_cholesky_fails():
    # A rank-one PSD matrix whose float32 rounding leaves eigenvalues below −1e-12.
    u = jax.random.normal(jax.random.key(0), (50,), dtype=jnp.float32)
    matrix = jnp.outer(u, u) + 1e-3 * jnp.outer(u[::-1], u[::-1])
    block = ef.blocks.Full(matrix, (jax.ShapeDtypeStruct((50,), jnp.float32),))
    assert not bool(
        jnp.all(
            jnp.isfinite(
                jnp.linalg.cholesky(matrix + 1e-12 * jnp.eye(50, dtype=jnp.float32))
            )
        )
    )
    (x,) = block.solve((u,), 1e-12)
    assert bool(jnp.all(jnp.isfinite(x)))
    assert bool(jnp.isfinite(block.logdet(1e-12)))
    # The fallback is defined as the clamped spectrum (float32 cannot resolve the
    # zero eigenvalues better than ±eps·‖B‖, so that is what it can promise) ...
    values = jnp.maximum(jnp.linalg.eigvalsh(matrix), 0)
    expected = jnp.sum(jnp.log(values + jnp.float32(1e-12)))
    np.testing.assert_allclose(float(block.logdet(1e-12)), float(expected), rtol=1e-5)
    # ... and its solve is backward stable against the float64 matrix.
    b, x64 = np.asarray(matrix, np.float64), np.asarray(x, np.float64)
    residual = b @ x64 + 1e-12 * x64 - np.asarray(u, np.float64)
    scale = np.linalg.norm(b, 2) * np.linalg.norm(x64) + np.linalg.norm(u)
    assert np.linalg.norm(residual) <= 1e3 * EPS32 * scale


def test_kronecker_block_clamps_negative_factor_eigenvalues():
    # Factors with a tiny negative eigenvalue, as float32 rounding leaves them.
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (4, 4), jnp.float32))
    a = q @ jnp.diag(jnp.array([2.0, 1.0, 0.5, -1e-7], jnp.float32)) @ q.T
    g = jnp.diag(jnp.array([1.0, 3.0], jnp.float32))
    structure = (jax.ShapeDtypeStruct((2, 4), jnp.float32),)
    block = ef.blocks.KroneckerFactored(a, g, weight_perm=(0, 1), structure=structure)
    assert bool(jnp.all(block.eigenvalues() >= 0))
    assert bool(jnp.isfinite(block.logdet(1e-8)))
    (x,) = block.solve((jnp.ones((2, 4), jnp.float32),), 1e-7)
    assert bool(jnp.all(jnp.isfinite(x)))
