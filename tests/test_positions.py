"""Losses with several positions per example (tokens): the exact structures are
exact, including on a small transformer whose blocks are scanned."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef

from .helpers import dense_ggn_cross_entropy


F64 = jnp.float64
N, T, V, D = 4, 5, 11, 8


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(2, D, dtype=F64, key=k1)
        self.ln1 = eqx.nn.LayerNorm(D, dtype=F64)
        self.ln2 = eqx.nn.LayerNorm(D, dtype=F64)
        self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, dtype=F64, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # stacked over 2 blocks, applied in a lax.scan
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(V, D, dtype=F64, key=k[0])
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k[1], 2))
        self.head = eqx.nn.Linear(D, V, dtype=F64, key=k[2])

    def __call__(self, ids):
        x = jax.vmap(self.embed)(ids)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return eqx.combine(p, static)(h), None

        return jax.vmap(self.head)(jax.lax.scan(step, x, params)[0])


class PerToken(eqx.Module):
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(x)


def ce(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _reference(model, batch):
    return dense_ggn_cross_entropy(model, *batch)


def _cases():
    y = jax.random.randint(jax.random.key(2), (N, T), 0, V)
    per_token = PerToken(eqx.nn.Linear(D, V, dtype=F64, key=jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (N, T, D), F64)
    ids = jax.random.randint(jax.random.key(1), (N, T), 0, V)
    return {
        "per_token": (per_token, (x, y)),
        "transformer": (Transformer(jax.random.key(0)), (ids, y)),
    }


CASES = _cases()


@pytest.mark.parametrize("estimator", [ef.GGN(), ef.FisherExact()])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_structures_with_positions(case, estimator):
    model, batch = CASES[case]
    ref = _reference(model, batch)
    dense = ef.curvature(ce, model, batch, estimator=estimator, structure=ef.Dense())
    np.testing.assert_allclose(dense.as_matrix(), ref, atol=1e-12)
    diag = ef.curvature(ce, model, batch, estimator=estimator, structure=ef.Diagonal())
    np.testing.assert_allclose(diag.as_matrix(), np.diag(np.diag(ref)), atol=1e-12)
    blocks = ef.curvature(
        ce, model, batch, estimator=estimator, structure=ef.BlockDiagonal()
    )
    got = np.asarray(blocks.as_matrix())
    # Every entry is either the reference or zero (off the layer blocks), and the
    # diagonal blocks are complete: their trace is the reference's.
    assert np.all(np.isclose(got, ref, atol=1e-12) | (got == 0.0))
    np.testing.assert_allclose(np.trace(got), np.trace(ref), rtol=1e-12)


def test_ekfac_scales_with_positions():
    model, batch = CASES["per_token"]
    ref = _reference(model, batch)
    curv = ef.curvature(ce, model, batch, estimator=ef.GGN(), structure=ef.EKFAC())
    (block,) = curv.blocks.values()
    # Scales = diag(Qᵀ B Q), Q = Q_G ⊗ Q_A on the row-major vec of M = [W, b].
    q = np.kron(np.asarray(block.q_g), np.asarray(block.q_a))
    expected = np.diag(q.T @ _to_block_order(ref, D, V) @ q)
    np.testing.assert_allclose(
        np.asarray(block.scales).ravel(), expected, rtol=1e-9, atol=1e-14
    )


def _to_block_order(mat, d_in, d_out):
    """The (weight, bias) ravel order → the row-major vec of M = [W, b]."""
    idx = []
    for o in range(d_out):
        idx += [o * d_in + i for i in range(d_in)] + [d_out * d_in + o]
    idx = np.asarray(idx)
    return mat[np.ix_(idx, idx)]
