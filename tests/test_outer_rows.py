"""Per-example vectors as outer products from the main pass
(`eqfisher/_curvature/outer_rows.py`).

A dense layer applied once to each example has per-example vectors $c_{nk}
\\tilde a_n^\\top$; `Diagonal()` and EKFAC's scales are products of the inputs and
cotangents, with no pass per example and no N·K·P array (a 512-256-10 MLP at
batch 64: 757 ms a `Diagonal()` GGN before, 0.6 ms after). Checked against dense
float64 GGNs and empirical Fishers from `jax.jacfwd` / `jax.grad`
(tests/helpers.py), with and without biases, for "reduce" weight sharing, and
for the layers that keep the per-example pass (a layer applied twice, a layer
over positions).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqfisher as ef
from eqfisher._curvature import examples as examples_module

from .helpers import dense_empirical_fisher, dense_ggn_cross_entropy, perturbed


F64 = jnp.float64
N = 12


def _f64(tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(F64) if eqx.is_inexact_array(x) else x, tree
    )


class Twice(eqx.Module):
    """One hidden layer applied twice: its vectors are sums of two outer products."""

    inner: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.inner = eqx.nn.Linear(4, 4, key=k1)
        self.head = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.inner(jnp.tanh(self.inner(x)))))


class OverPositions(eqx.Module):
    """A dense layer over T positions, pooled: T outer products per example."""

    inner: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.inner = eqx.nn.Linear(4, 5, key=k1)
        self.head = eqx.nn.Linear(5, 3, key=k2)

    def __call__(self, x):  # (T, 4)
        return self.head(jnp.mean(jnp.tanh(jax.vmap(self.inner)(x)), axis=0))


class Scanned(eqx.Module):
    """Three stacked dense layers applied by `lax.scan` (each step its own)."""

    inner: eqx.nn.Linear
    blocks: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.inner = eqx.nn.Linear(4, 5, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(5, 5, key=k))(
            jr.split(k2, 3)
        )
        self.head = eqx.nn.Linear(5, 3, key=k3)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        h, _ = jax.lax.scan(step, jnp.tanh(self.inner(x)), params)
        return self.head(h)


class Declared(eqx.Module):
    """A scaled projection `(x @ w) * s + b` declared as the dense layer
    `x @ w + b` (`ef.register_dense` says what `y` is; its derivative is what
    computes it): the outer products would trust the declaration."""

    weight: jax.Array
    bias: jax.Array
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.weight = jr.normal(k1, (4, 5)) / 2
        self.bias = jnp.full((5,), 0.1)
        self.head = eqx.nn.Linear(5, 3, key=k2)

    def __call__(self, x):
        y = (x @ self.weight) * (1 / jnp.sqrt(4.0)) + self.bias
        y = ef.register_dense(y, x, self.weight, self.bias)
        return self.head(jnp.tanh(y))


def _model(name, use_bias=True):
    key = jr.key(0)
    if name == "scanned":
        model = Scanned(key)
    elif name == "mlp":
        model = eqx.nn.MLP(
            4,
            3,
            6,
            2,
            activation=jnp.tanh,
            key=key,
            use_bias=use_bias,
            use_final_bias=use_bias,
        )
    elif name == "twice":
        model = Twice(key)
    elif name == "declared":
        model = Declared(key)
    else:
        model = OverPositions(key)
    model = perturbed(_f64(model), jr.key(1))
    shape = (N, 5, 4) if name == "positions" else (N, 4)
    x = jr.normal(jr.key(2), shape, F64)
    y = jr.randint(jr.key(3), (N,), 0, 3)
    return model, (x, y)


def _loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _diagonal(curv) -> np.ndarray:
    return np.asarray(ravel_pytree(curv.diagonal())[0])


@pytest.mark.parametrize(
    "name, use_bias",
    [
        ("mlp", True),
        ("mlp", False),
        ("scanned", True),
        ("twice", True),
        ("positions", True),
        ("declared", True),
    ],
)
def test_diagonal_equals_the_dense_ggn(name, use_bias):
    model, (x, y) = _model(name, use_bias)
    ref = dense_ggn_cross_entropy(model, x, y)
    curv = ef.curvature(
        _loss, model, (x, y), estimator=ef.GGN(), structure=ef.Diagonal()
    )
    np.testing.assert_allclose(_diagonal(curv), np.diag(ref), rtol=1e-12, atol=1e-15)
    block = ef.curvature(
        _loss, model, (x, y), estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    np.testing.assert_allclose(
        np.asarray(block.as_matrix()) * (np.asarray(block.as_matrix()) != 0),
        ref * (np.asarray(block.as_matrix()) != 0),
        rtol=1e-12,
        atol=1e-15,
    )


def test_diagonal_equals_the_dense_empirical_fisher():
    model, batch = _model("mlp")

    def one(m, example):
        x, y = example
        return _loss(m, (x[None], y[None]))

    ref = dense_empirical_fisher(one, model, batch)
    curv = ef.curvature(
        _loss, model, batch, estimator=ef.EmpiricalFisher(), structure=ef.Diagonal()
    )
    np.testing.assert_allclose(_diagonal(curv), np.diag(ref), rtol=1e-12, atol=1e-15)


def _ekfac_scales_reference(ref, ekfac_block, idx, d_out, d_in, bias):
    """diag((Q_G ⊗ Q_A)ᵀ B (Q_G ⊗ Q_A)), B the reference's block in vec([W | b])
    order, with the eigenbases of the EKFAC block (K-FAC's factors')."""
    cols = d_in + bias
    order = [k * cols + j for k in range(d_out) for j in range(d_in)]
    order += [k * cols + d_in for k in range(d_out)] if bias else []
    b_ravel = ref[np.ix_(idx, idx)]
    b_vec = np.zeros_like(b_ravel)
    b_vec[np.ix_(order, order)] = b_ravel
    q = np.kron(np.asarray(ekfac_block.q_g), np.asarray(ekfac_block.q_a))
    return np.diag(q.T @ b_vec @ q).reshape(ekfac_block.scales.shape)


def test_ekfac_of_scanned_layers_has_the_exact_trace():
    # EKFAC's scales are the exact diagonal in K-FAC's eigenbasis, so each block's
    # trace is the exact GGN block's (the scan's steps, from every step's factors
    # at once).
    model, (x, y) = _model("scanned")
    ref = dense_ggn_cross_entropy(model, x, y)
    curv = ef.curvature(_loss, model, (x, y), estimator=ef.GGN(), structure=ef.EKFAC())
    exact = ef.curvature(
        _loss, model, (x, y), estimator=ef.GGN(), structure=ef.BlockDiagonal()
    )
    assert len(curv.blocks) == len(exact.blocks) == 5  # inner, 3 steps, head
    for name, block in curv.blocks.items():
        np.testing.assert_allclose(
            block.trace(), exact.blocks[name].trace(), rtol=1e-10
        )
    np.testing.assert_allclose(curv.trace(), np.trace(ref), rtol=1e-10)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("estimator", [ef.GGN(), ef.FisherExact()], ids=repr)
def test_ekfac_scales_are_the_dense_ggn_in_the_kfac_eigenbasis(
    use_bias, sharing, estimator
):
    model, (x, y) = _model("mlp", use_bias)
    ref = dense_ggn_cross_entropy(model, x, y)
    curv = ef.curvature(
        _loss,
        model,
        (x, y),
        estimator=estimator,
        structure=ef.EKFAC(weight_sharing=sharing),
    )
    sizes = [
        leaf.size
        for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    ]
    starts = np.cumsum([0] + sizes)
    per_layer = 2 if use_bias else 1
    for i, layer in enumerate(model.layers):
        block = curv.blocks[f"layers[{i}]"]
        first = i * per_layer
        idx = np.arange(starts[first], starts[first + per_layer])
        d_out, d_in = layer.weight.shape
        expected = _ekfac_scales_reference(ref, block, idx, d_out, d_in, use_bias)
        np.testing.assert_allclose(block.scales, expected, rtol=1e-10, atol=1e-14)


def test_only_the_weights_selected():
    # `where` selects each layer's weight: the vectors lose the bias's column.
    model, (x, y) = _model("mlp")
    where = ef.filters.by_path("*weight")
    ref = dense_ggn_cross_entropy(model, x, y)
    curv = ef.curvature(
        _loss, model, (x, y), estimator=ef.GGN(), structure=ef.Diagonal(), where=where
    )
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    starts = np.cumsum([0] + [leaf.size for leaf in leaves])
    weights = np.concatenate(
        [np.arange(starts[i], starts[i + 1]) for i in range(0, len(leaves), 2)]
    )
    got = _diagonal(curv)  # the weights' entries, the biases' are None
    np.testing.assert_allclose(got, np.diag(ref)[weights], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "name, outer",
    [
        ("mlp", True),
        ("scanned", True),
        ("twice", False),
        ("positions", False),
        ("declared", False),
    ],
)
def test_which_layers_skip_the_pass_per_example(monkeypatch, name, outer):
    # The MLP's dense layers take their vectors from the main pass: the pass per
    # example forms none. A layer applied twice, or over positions, keeps it.
    formed = []
    original = examples_module._pass_per_example

    def spy(staged, estimator, axis, main, parts, rest):
        formed.append(list(rest))
        return original(staged, estimator, axis, main, parts, rest)

    monkeypatch.setattr(examples_module, "_pass_per_example", spy)
    model, (x, y) = _model(name)
    # A batch of a size no other test uses: `curvature` is traced again.
    batch = (x[:7], y[:7])
    ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.Diagonal())
    rest = [i for call in formed for i in call]
    if outer:
        # The example axes prove the examples independent: no pass at all.
        assert rest == []
    else:
        assert rest  # the hidden layer's vectors come from the pass per example
