"""`KFAC(max_factor_dim=...)`: factors above the size kept diagonal, against dense
float64 references written without eqfisher (`kfac_reference.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import ravelled, tree_allclose
from .kfac_reference import (
    as_matrix,
    cross_entropy,
    kfac_factors,
    kronecker_dense,
    layer_slice,
)


F64 = jnp.float64
N, IN, HIDDEN, OUT = 7, 3, 6, 4
MAX = 5  # layers[0]: A 4×4 dense, G 6 → diagonal; layers[1]: A 7 → diagonal, G 4×4
LAM = 0.1


def _problem():
    model = eqx.nn.MLP(
        IN, OUT, HIDDEN, 1, activation=jnp.tanh, dtype=F64, key=jr.key(4)
    )
    kx, ky = jr.split(jr.key(5))
    return model, (jr.normal(kx, (N, IN), F64), jr.randint(ky, (N,), 0, OUT))


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _factors(model, batch, k):
    a, g = kfac_factors(model, *batch, k)
    keep = lambda f: np.diag(np.diag(f)) if f.shape[0] > MAX else f
    return keep(a), keep(g)


def _reference(model, batch) -> np.ndarray:
    size = ravelled(model)[0].size
    out = np.zeros((size, size))
    for k in (0, 1):
        idx = layer_slice(model, k)
        out[np.ix_(idx, idx)] = kronecker_dense(*_factors(model, batch, k))
    return out


def test_factors_above_the_size_are_their_diagonals():
    model, batch = _problem()
    structure = ef.KFAC(max_factor_dim=MAX)
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    b0, b1 = curv.blocks["layers[0]"], curv.blocks["layers[1]"]
    assert (b0.a.shape, b0.g.shape, b1.a.shape, b1.g.shape) == (
        (4, 4),
        (6,),
        (7,),
        (4, 4),
    )
    ref = _reference(model, batch)
    np.testing.assert_allclose(as_matrix(curv), ref, rtol=1e-10, atol=1e-12)

    params = eqx.filter(model, eqx.is_inexact_array)
    v = jax.tree_util.tree_map(
        lambda p: jnp.cos(jnp.arange(p.size)).reshape(p.shape), params
    )
    flat_v, unravel = jax.flatten_util.ravel_pytree(v)
    eye = np.eye(ref.shape[0])
    assert tree_allclose(curv.mv(v), unravel(ref @ flat_v))
    assert tree_allclose(
        curv.solve(v, LAM), unravel(np.linalg.solve(ref + LAM * eye, flat_v))
    )
    assert tree_allclose(curv.diagonal(), unravel(np.diag(ref)))
    np.testing.assert_allclose(
        curv.logdet(LAM), np.linalg.slogdet(ref + LAM * eye)[1], rtol=1e-10
    )
    np.testing.assert_allclose(curv.trace(), np.trace(ref), rtol=1e-10)

    # π-damping with a diagonal factor: (G + √λ/π I)⁻¹ ⊗ (A + π√λ I)⁻¹.
    a, g = _factors(model, batch, 0)
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    inv = lambda f, s: np.linalg.inv(f + s * np.eye(f.shape[0]))
    np.testing.assert_allclose(
        b0.pi_damped_inverse(LAM).as_matrix(),
        kronecker_dense(inv(a, pi * np.sqrt(LAM)), inv(g, np.sqrt(LAM) / pi)),
        rtol=1e-10,
    )


def test_kfac_step_with_diagonal_factors():
    model, batch = _problem()
    structure = ef.KFAC(max_factor_dim=MAX)
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=structure)
    lr = 0.5
    opt = ef.optim.kfac(
        lr,
        like=ef.optim.curvature_like(vgc, model, batch),
        damping=LAM,
        momentum=0.0,
        damping_variant=ef.optim.Tikhonov(),
        graft=None,  # the plain damped Newton step
    )
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=structure)
    new, _, _ = step(model, opt.init(eqx.filter(model, eqx.is_inexact_array)), batch)

    flat, rebuild = ravelled(model)
    grad = jax.grad(
        lambda f: jnp.mean(
            jax.vmap(cross_entropy)(jax.vmap(rebuild(f))(batch[0]), batch[1])
        )
    )(flat)
    c = _reference(model, batch)
    expected = flat - lr * np.linalg.solve(c + LAM * np.eye(c.shape[0]), grad)
    assert tree_allclose(ravelled(new)[0], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_max_factor_dim(bad, unchecked):
    with pytest.raises(ValueError, match="max_factor_dim"):
        ef.KFAC(max_factor_dim=bad)


class _Tokens(eqx.Module):
    emb: eqx.nn.Embedding
    conv: eqx.nn.Conv1d
    head: eqx.nn.Linear

    def __call__(self, ids):
        h = jnp.tanh(self.conv(jax.vmap(self.emb)(ids).T))  # (4, 4)
        return self.head(h.reshape(-1))


def test_embedding_and_conv_factors_above_the_size_are_diagonals():
    # emb: A 12 → diagonal; conv: A 3·2 + 1 = 7 → diagonal; head: A 17 → diagonal;
    # every G (3, 4, 5) stays dense. The full factors are K-FAC's, tested against
    # references in test_curvature.py and test_reference.py.
    k = jr.split(jr.key(6), 4)
    model = _Tokens(
        eqx.nn.Embedding(12, 3, dtype=F64, key=k[0]),
        eqx.nn.Conv1d(3, 4, 2, dtype=F64, key=k[1]),
        eqx.nn.Linear(16, 5, dtype=F64, key=k[2]),
    )
    batch = (jr.randint(k[3], (N, 5), 0, 12), jnp.arange(N) % 5)
    full, diagonal = (
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=s)
        for s in (ef.KFAC(), ef.KFAC(max_factor_dim=6))
    )
    for name in ("emb", "conv", "head"):
        f, d = full.blocks[name], diagonal.blocks[name]
        assert d.a.ndim == 1 and d.g.ndim == 2
        np.testing.assert_allclose(d.a, jnp.diagonal(f.a), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(d.g, f.g, rtol=1e-12, atol=1e-14)
