"""Examples that interact inside `loss_fn`: detected, with exact ways out.

BatchNorm with batch statistics (both Equinox modes), a time-major batch through a
scanned GRU, and one dropout key for the whole batch. The per-example structures
raise under the default `IndependentExamples()`; `InteractingExamples()` (full-batch
products) and `IndependentExamples(axis=...)` agree with dense float64 GGNs from
`jax.jacfwd`/`jax.hessian` (tests/helpers.py).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import block_slices, dense_ggn, tree_allclose
from .zoo import GRUClassifier


def _f64(tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, tree
    )


def _mse(out, t):
    return jnp.mean(0.5 * jnp.sum((out - t) ** 2, axis=-1))


class _BNNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, mode, key):
        k1, k2 = jr.split(key)
        self.l1 = eqx.nn.Linear(3, 4, key=k1)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode=mode)
        self.l2 = eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(jnp.tanh(self.l1(x)), state)
        return self.l2(h), state


def _batchnorm(mode):
    model, state = eqx.nn.make_with_state(_BNNet)(mode, jr.key(0))
    model, state = _f64(model), _f64(state)
    x = jr.normal(jr.key(1), (6, 3), jnp.float64)
    t = jr.normal(jr.key(2), (6, 2), jnp.float64)

    def outputs(m, x):
        fn = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return fn(x, state)[0]

    def loss_fn(m, b):
        return ef.squared_error(outputs(m, b[0]), b[1])

    ref = dense_ggn(lambda m: outputs(m, x), lambda o: _mse(o, t), model)
    return loss_fn, model, (x, t), ref


def _rnn_logits(m, x):
    # Time-major: x is (T, N, F); the scan runs over time, vmap over examples.
    def step(h, xt):
        h = jax.vmap(m.cell)(xt, h)
        return h, jax.vmap(m.head)(h)

    h0 = jnp.zeros((x.shape[1], 3), x.dtype)
    return jax.lax.scan(step, h0, x)[1]


def _time_major(n=3):
    model = _f64(GRUClassifier(jr.key(3)))
    x = jr.normal(jr.key(4), (4, n, 2), jnp.float64)  # (T, N, F)
    y = jr.randint(jr.key(5), (4, n), 0, 4)  # (T, N)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(_rnn_logits(m, b[0]), b[1])

    def ce(o):
        onehot = jax.nn.one_hot(y, 4, dtype=o.dtype)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(o), axis=-1))

    ref = dense_ggn(lambda m: _rnn_logits(m, x), ce, model)
    return loss_fn, model, (x, y), ref


def _dropout():
    model = _f64(eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=jr.key(6)))
    x = jr.normal(jr.key(7), (5, 3), jnp.float64)
    t = jr.normal(jr.key(8), (5, 2), jnp.float64)
    dropout = eqx.nn.Dropout(0.5)

    def outputs(m, x):
        h = jnp.tanh(jax.vmap(m.layers[0])(x))
        h = dropout(h, key=jr.key(9))  # one key, one mask for the whole batch
        return jax.vmap(m.layers[1])(h)

    def loss_fn(m, b):
        return ef.squared_error(outputs(m, b[0]), b[1])

    ref = dense_ggn(lambda m: outputs(m, x), lambda o: _mse(o, t), model)
    return loss_fn, model, (x, t), ref


SETUPS = {
    "batchnorm_ema": lambda: _batchnorm("ema"),
    "batchnorm_batch": lambda: _batchnorm("batch"),
    "time_major_gru": _time_major,
    "shared_dropout_key": _dropout,
}
STRUCTURES = [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal()]


def _restrict(ref, model, structure, curv):
    """The reference restricted to the structure's pattern (blocks as `curv` groups
    the leaves; values from the reference)."""
    if isinstance(structure, ef.Diagonal):
        return np.diag(np.diag(ref))
    if isinstance(structure, ef.BlockDiagonal):
        out = np.zeros_like(ref)
        sl = block_slices(model)
        for _, positions in curv.leaf_indices:
            idx = np.concatenate(
                [np.arange(sl[i].start, sl[i].stop) for i in positions]
            )
            out[np.ix_(idx, idx)] = ref[np.ix_(idx, idx)]
        return out
    return ref


# With one dropout key for the batch the examples do not read each other's
# data (the example axes prove it), but an example run alone draws another mask:
# the per-example pass (`Dense()`) refuses; the structures whose vectors all come
# from the main pass (an MLP's dense layers: `Diagonal()`, `BlockDiagonal()`,
# EKFAC's scales) need no run alone and are exact
# (`test_main_pass_vectors_need_no_run_alone`).
MAIN_PASS = [ef.BlockDiagonal(), ef.Diagonal(), ef.EKFAC()]
CHECKED = [
    (setup, s)
    for setup in SETUPS
    for s in STRUCTURES + [ef.EKFAC()]
    if not (setup == "shared_dropout_key" and s in MAIN_PASS)
]
# K-FAC's Kronecker blocks need no per-example pass; its exact diagonal blocks
# (BatchNorm's scale and shift) do.
CHECKED += [("batchnorm_ema", ef.KFAC()), ("batchnorm_batch", ef.KFAC())]


@pytest.mark.parametrize(("setup", "structure"), CHECKED, ids=repr)
def test_interaction_is_detected(setup, structure):
    loss_fn, model, batch, _ = SETUPS[setup]()
    with pytest.raises(eqx.EquinoxRuntimeError, match="examples interact"):
        ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=structure
        ).diagonal()


@pytest.mark.parametrize("structure", MAIN_PASS, ids=repr)
def test_main_pass_vectors_need_no_run_alone(structure):
    loss_fn, model, batch, ref = SETUPS["shared_dropout_key"]()
    got = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    if isinstance(structure, ef.EKFAC):
        # EKFAC's trace is the exact GGN's (its scales are the exact diagonal in
        # K-FAC's eigenbasis).
        np.testing.assert_allclose(got.trace(), np.trace(ref), rtol=1e-10)
        return
    np.testing.assert_allclose(
        got.as_matrix(), _restrict(ref, model, structure, got), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("structure", STRUCTURES, ids=repr)
def test_interacting_examples_are_exact(setup, structure):
    loss_fn, model, batch, ref = SETUPS[setup]()
    got = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=structure,
        examples=ef.InteractingExamples(),
    )
    np.testing.assert_allclose(
        got.as_matrix(), _restrict(ref, model, structure, got), rtol=1e-9, atol=1e-12
    )


def test_kfac_scale_and_shift_block_is_exact_with_interacting_examples():
    loss_fn, model, batch, ref = _batchnorm("batch")
    curv = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        examples=ef.InteractingExamples(),
    )
    sl = block_slices(model)  # l1.weight, l1.bias, bn.weight, bn.bias, ...
    weight, bias = curv.blocks["bn"].diagonal()
    np.testing.assert_allclose(weight, np.diag(ref)[sl[2]], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(bias, np.diag(ref)[sl[3]], rtol=1e-9, atol=1e-12)


def _time_major_curvature(structure, axis, n=3):
    loss_fn, model, batch, ref = _time_major(n)
    got = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=structure,
        examples=ef.IndependentExamples(axis=axis),
    )
    return got, _restrict(ref, model, structure, got)


@pytest.mark.parametrize("structure", STRUCTURES, ids=repr)
def test_time_major_example_axis(structure):
    got, ref = _time_major_curvature(structure, 1)
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-9, atol=1e-12)
    # A PyTree prefix of the batch, as jax.vmap's in_axes.
    again, _ = _time_major_curvature(structure, (1, 1))
    np.testing.assert_allclose(again.as_matrix(), got.as_matrix(), rtol=1e-12)


@pytest.mark.parametrize("structure", [ef.Dense(), ef.Diagonal()], ids=repr)
def test_time_major_batch_of_one_example(structure):
    """With one example the loss's shapes are the same with one example as with
    the batch, and its example axis was taken to be the first: vmap's
    "inconsistent sizes" for a time-major `(T, 1, F)` batch."""
    got, ref = _time_major_curvature(structure, 1, n=1)
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-9, atol=1e-12)


def test_interacting_empirical_fisher_is_exact():
    # Σₙ wₙ ∇ℓₙ ∇ℓₙᵀ, ∇ℓₙ the gradient of example n's loss through the whole batch.
    loss_fn, model, (x, t), _ = _batchnorm("batch")
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    state = None

    def per_example(f):
        m = eqx.combine(unravel(f), static)
        return jax.vmap(
            lambda o, tt: 0.5 * jnp.sum((o - tt) ** 2),
        )(_bn_outputs(m, x), t)

    del state
    g = jax.jacfwd(per_example)(flat)  # (N, P)
    ref = g.T @ g / x.shape[0]
    got = ef.curvature(
        loss_fn,
        model,
        (x, t),
        estimator=ef.EmpiricalFisher(),
        structure=ef.Dense(),
        examples=ef.InteractingExamples(),
    )
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-9, atol=1e-12)


def _bn_outputs(m, x):
    _, state = eqx.nn.make_with_state(_BNNet)("batch", jr.key(0))
    fn = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return fn(x, _f64(state))[0]


def test_value_grad_and_curvature_under_jit_and_vmap():
    model = _f64(eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jr.key(0)))
    xs = jr.normal(jr.key(1), (2, 5, 3), jnp.float64)
    ts = jr.normal(jr.key(2), (2, 5, 2), jnp.float64)

    def loss_fn(m, b):
        return ef.squared_error(jax.vmap(m)(b[0]), b[1])

    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.Diagonal()
    )
    values, grads, curvs = eqx.filter_jit(eqx.filter_vmap(vgc, in_axes=(None, 0)))(
        model, (xs, ts)
    )
    for i in range(2):
        batch = (xs[i], ts[i])
        ref = dense_ggn(
            lambda m, x=xs[i]: jax.vmap(m)(x),
            lambda o, t=ts[i]: _mse(o, t),
            model,
        )
        np.testing.assert_allclose(values[i], loss_fn(model, batch), rtol=1e-12)
        grad_i = jax.tree_util.tree_map(lambda g, i=i: g[i], grads)
        assert tree_allclose(grad_i, eqx.filter_grad(loss_fn)(model, batch))
        diag = jax.flatten_util.ravel_pytree(
            jax.tree_util.tree_map(lambda d, i=i: d[i], curvs.diagonal())
        )[0]
        np.testing.assert_allclose(diag, np.diag(ref), rtol=1e-10, atol=1e-12)


def test_batch_without_a_shared_example_axis_names_the_option():
    loss_fn, model, batch, _ = _time_major()
    with pytest.raises(ValueError, match=r"IndependentExamples\(axis=...\)"):
        ef.curvature(
            loss_fn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.Diagonal(),
            examples=ef.IndependentExamples(axis=(1, 0)),
        )


@pytest.mark.parametrize("structure", [ef.KFAC, ef.EKFAC], ids=lambda s: s.__name__)
def test_reduce_refuses_examples_off_the_leading_axis(structure):
    # "reduce" averages each example's inputs over the layer's locations, taking
    # the examples as the first location axis: on a time-major batch that is time,
    # and the factors were those of the time steps (A 21% off), silently.
    lin = eqx.nn.Linear(3, 2, key=jr.key(0))
    x, y = jr.normal(jr.key(1), (4, 5, 3)), jr.normal(jr.key(2), (4, 5, 2))

    def loss_fn(model, batch):
        x, y = batch
        return ef.squared_error(jax.vmap(jax.vmap(model))(x), y)

    with pytest.raises(ValueError, match=r'leading axis[\s\S]*weight_sharing="expand"'):
        ef.curvature(
            loss_fn,
            lin,
            (x, y),
            estimator=ef.GGN(),
            structure=structure(weight_sharing="reduce"),
            examples=ef.IndependentExamples(axis=1),
        )


@pytest.mark.parametrize("axis", [1, 3, -1])
def test_an_interacting_example_axis_beyond_the_leading_axes_is_refused(axis):
    # A loss on (N, out) inputs has one leading axis: `axis=1` took the output axis
    # for the examples (an empirical Fisher 92% off, no error); 3 and -1 gave JAX's
    # "out of bounds" and "isn't a permutation".
    model = eqx.nn.MLP(4, 3, 5, 1, key=jr.key(0), dtype=jnp.float64)
    x, y = jr.normal(jr.key(1), (10, 4)), jnp.arange(10) % 3

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    with pytest.raises(ValueError, match=r"0 <= axis < 1 for a loss whose inputs"):
        ef.curvature(
            loss_fn,
            model,
            (x, y),
            estimator=ef.EmpiricalFisher(),
            structure=ef.Dense(),
            examples=ef.InteractingExamples(axis=axis),
        )


@pytest.mark.parametrize(
    "structure", [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal()], ids=repr
)
def test_an_interaction_that_is_nan_for_one_example_is_detected(structure):
    # Logits z-scored over the batch without an epsilon: one example alone is 0/0,
    # NaN, which the comparison with the batch's outputs took as equal (Dense gave
    # NaN, BlockDiagonal and Diagonal finite blocks 95% off, no error).
    model = _f64(eqx.nn.MLP(3, 4, 5, 1, activation=jnp.tanh, key=jr.key(0)))
    x = jr.normal(jr.key(1), (8, 3), jnp.float64)
    y = jnp.arange(8) % 4

    def outputs(m, x):
        logits = jax.vmap(m)(x)
        return (logits - logits.mean(0, keepdims=True)) / logits.std(0, keepdims=True)

    def loss_fn(m, b):
        return ef.softmax_cross_entropy(outputs(m, b[0]), b[1])

    with pytest.raises(eqx.EquinoxRuntimeError, match="examples interact"):
        ef.curvature(loss_fn, model, (x, y), estimator=ef.GGN(), structure=structure)
    # With the examples declared interacting: J^T H J, against jax.jacfwd.
    got = ef.curvature(
        loss_fn,
        model,
        (x, y),
        estimator=ef.GGN(),
        structure=structure,
        examples=ef.InteractingExamples(),
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    out = lambda p: outputs(eqx.combine(unravel(p), static), x)
    jac = jax.jacfwd(out)(flat).reshape(-1, flat.size)
    hess = jax.hessian(lambda o: ef.softmax_cross_entropy(o.reshape(8, 4), y))(
        out(flat).reshape(-1)
    )
    ref = jac.T @ hess @ jac
    np.testing.assert_allclose(
        got.as_matrix(), _restrict(ref, model, structure, got), rtol=1e-9, atol=1e-12
    )
