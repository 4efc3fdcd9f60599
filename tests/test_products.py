"""Exact matrix-free operators (`ggn_operator`, `hessian_operator`,
`empirical_fisher_operator`) against dense float64 references."""

import functools as ft

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import eqfisher as ef

from .helpers import compiled_during, dense_hessian, ravelled, tree_allclose
from .test_curvature import (
    DAMPING,
    LOSS_FNS,
    LOSSES,
    assert_close,
    batch_for,
    curv_for,
    empirical_fisher_of,
    ggn_of,
    mean_loss,
    mlp,
    random_like,
    small_batch,
    small_mlp,
)


# name: (operator, reference (model, batch, loss) -> dense matrix, symmetric, PSD)
OPERATORS = {
    "ggn": (ef.ggn_operator, ggn_of, True, True),
    "hessian": (ef.hessian_operator, None, True, False),
    "empirical_fisher": (
        ef.empirical_fisher_operator,
        empirical_fisher_of,
        True,
        True,
    ),
}


@eqx.filter_jit
def hessian_of(model, batch, loss: str):
    """The Hessian of the mean loss in the ravelled parameters (`jax.hessian`)."""
    flat, rebuild = ravelled(model)
    x, y = batch
    return jax.hessian(lambda f: mean_loss(loss, jax.vmap(rebuild(f))(x), y))(flat)


def reference(name: str, model, batch, loss: str) -> np.ndarray:
    of = OPERATORS[name][1] or hessian_of
    return np.asarray(of(model, batch, loss))


@ft.cache
def operator_results(loss: str):
    """For each operator: `(as_matrix, mv(v), tags)`, from one compilation."""
    model, batch = mlp(), batch_for(loss)
    v = random_like(model, 3)

    @eqx.filter_jit
    def run(model, batch, v):
        out = {}
        for name, (make, *_) in OPERATORS.items():
            op = make(LOSS_FNS[loss], model, batch)
            tags = (
                lx.is_symmetric(op),
                lx.is_positive_semidefinite(op),
                lx.is_negative_semidefinite(op),
            )
            out[name] = (op.as_matrix(), op.mv(v), tags)
        return out

    return run(model, batch, v), v


@pytest.mark.parametrize("name", list(OPERATORS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_operator_matches_dense_reference(loss, name):
    (results, v) = operator_results(loss)
    matrix, mv, _ = results[name]
    model, batch = mlp(), batch_for(loss)
    expected = reference(name, model, batch, loss)
    assert np.abs(expected).max() > 1e-3
    assert_close(matrix, expected)
    flat_v, unravel = jax.flatten_util.ravel_pytree(v)
    assert tree_allclose(mv, unravel(jnp.asarray(expected @ np.asarray(flat_v))))


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_tags(name):
    (results, _) = operator_results("softmax_ce")
    symmetric, psd, nsd = results[name][2]
    assert symmetric is OPERATORS[name][2]
    assert psd is OPERATORS[name][3]
    assert nsd is False


@pytest.mark.parametrize("loss", list(LOSSES))
def test_hessian_differs_from_ggn(loss):
    # A tanh network is not linear: the Hessian has the residual term the GGN drops,
    # so the two tests above are not checking one matrix twice.
    (results, _) = operator_results(loss)
    gap = np.asarray(results["hessian"][0]) - np.asarray(results["ggn"][0])
    assert np.abs(gap).max() > 1e-3
    # The Hessian of a tanh network is indefinite, the GGN is not.
    assert np.linalg.eigvalsh(np.asarray(results["ggn"][0])).min() > -1e-12


def test_eager_ggn_operator_and_compiled_hessian():
    # Outside `jit` (a small model: eager JAX compiles every operation); also checks
    # `hessian_of` against `helpers.dense_hessian`.
    loss = "sigmoid_ce"
    model, batch = small_mlp(), small_batch()
    x, y = batch
    loss_fn = LOSS_FNS[loss]
    ggn = np.asarray(ggn_of(model, batch, loss))
    hess = dense_hessian(lambda m: mean_loss(loss, jax.vmap(m)(x), y), model)
    assert_close(hessian_of(model, batch, loss), hess)
    assert np.abs(hess - ggn).max() > 1e-3
    v = random_like(model, 1)
    flat_v, unravel = jax.flatten_util.ravel_pytree(v)
    expected = unravel(jnp.asarray(ggn @ np.asarray(flat_v)))
    assert tree_allclose(ef.ggn_operator(loss_fn, model, batch).mv(v), expected)


def test_cg_with_damping_on_ggn_operator():
    loss = "softmax_ce"
    model, batch = mlp(), batch_for(loss)
    g = random_like(model, 9)

    @eqx.filter_jit
    def solve(model, batch, g):
        op = ef.ggn_operator(LOSS_FNS[loss], model, batch)
        damped = op + DAMPING * lx.IdentityLinearOperator(op.in_structure())
        damped = lx.TaggedLinearOperator(damped, lx.positive_semidefinite_tag)
        sol = lx.linear_solve(damped, g, lx.CG(rtol=1e-12, atol=1e-12, max_steps=500))
        return sol.value

    x = solve(model, batch, g)
    ggn = np.asarray(ggn_of(model, batch, loss))
    flat_g, unravel = jax.flatten_util.ravel_pytree(g)
    expected = np.linalg.solve(ggn + DAMPING * np.eye(len(ggn)), np.asarray(flat_g))
    assert tree_allclose(x, unravel(jnp.asarray(expected)), rtol=1e-8, atol=1e-10)
    # And it agrees with the structured curvature's exact solve.
    curv = curv_for(loss, ef.GGN(), ef.Dense())
    assert tree_allclose(curv.solve(g, DAMPING), x, rtol=1e-8, atol=1e-10)


class _TwoHeads(eqx.Module):
    """A token classifier and a per-sequence regression head on one encoder."""

    encoder: eqx.nn.Linear
    tokens: eqx.nn.Linear
    value: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.Linear(3, 4, dtype=jnp.float64, key=k1)
        self.tokens = eqx.nn.Linear(4, 3, dtype=jnp.float64, key=k2)
        self.value = eqx.nn.Linear(4, 2, dtype=jnp.float64, key=k3)

    def __call__(self, x):  # (T, 3) -> (T, 3) logits, (2,) value
        h = jnp.tanh(jax.vmap(self.encoder)(x))
        return jax.vmap(self.tokens)(h), self.value(h.mean(0))


@pytest.mark.parametrize("heads", [1, 2])
def test_empirical_fisher_operator_sums_an_examples_positions(heads):
    # Example n's gradient in a registered loss is that of its whole loss there,
    # every position with its weight (uₙ = Σₜ √wₙₜ ∇(entry)), and the registered
    # losses add their matrices (`EmpiricalFisher()`'s "What an estimator
    # computes": vectors per registered loss).
    n, t = 5, 4
    model = _TwoHeads(jax.random.key(0))
    kx, ky, kv = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (n, t, 3), jnp.float64)
    y = jax.random.randint(ky, (n, t), 0, 3)
    target = jax.random.normal(kv, (n, 2), jnp.float64)
    mask = jnp.arange(t)[None, :] < jnp.array([4, 2, 3, 4, 1])[:, None]
    batch = (x, y, mask, target)

    def loss_fn(model, batch):
        x, y, mask, target = batch
        logits, values = jax.vmap(model)(x)
        loss = ef.softmax_cross_entropy(logits, y, mask=mask)
        return loss + ef.squared_error(values, target) if heads == 2 else loss

    flat, rebuild = ravelled(model)

    def tokens(f, x, y, mask, target):  # one example's masked token losses
        logits, _ = rebuild(f)(x)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]
        return jnp.sum(jnp.where(mask, ce, 0.0))

    def value(f, x, y, mask, target):  # ½‖·‖², a mean over the n examples
        return 0.5 * jnp.sum((rebuild(f)(x)[1] - target) ** 2)

    per_example = ft.partial(jax.vmap, in_axes=(None, 0, 0, 0, 0))
    u = per_example(jax.grad(tokens))(flat, *batch) / jnp.sqrt(mask.sum())
    expected = np.asarray(u.T @ u)
    if heads == 2:
        u = per_example(jax.grad(value))(flat, *batch) / jnp.sqrt(n)
        expected = expected + np.asarray(u.T @ u)
    got = ef.empirical_fisher_operator(loss_fn, model, batch).as_matrix()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-14)
    curv = ef.curvature(
        loss_fn, model, batch, estimator=ef.EmpiricalFisher(), structure=ef.Dense()
    )
    np.testing.assert_allclose(curv.as_matrix(), expected, rtol=1e-10, atol=1e-14)


@jax.custom_vjp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


def _softplus_fwd(x):
    return _softplus(x), x


def _softplus_bwd(x, g):
    return (g * jax.nn.sigmoid(x),)


_softplus.defvjp(_softplus_fwd, _softplus_bwd)


class _CustomActivation(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(jax.jit(_softplus)(self.a(x)))  # inside a jit, too


def test_output_products_through_a_custom_vjp_outside_the_layers():
    # A custom_vjp has no forward-mode rule: `mv` failed with JAX's "can't apply
    # forward-mode autodiff"; J v now comes from the transposed VJP.
    f64 = jnp.float64
    model = _CustomActivation(
        eqx.nn.Linear(3, 4, dtype=f64, key=jax.random.key(0)),
        eqx.nn.Linear(4, 2, dtype=f64, key=jax.random.key(1)),
    )
    x = jax.random.normal(jax.random.key(2), (5, 3), f64)
    y = jnp.array([0, 1, 1, 0, 1])

    def loss(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    def outputs(theta):
        return jax.vmap(eqx.combine(unravel(theta), static))(x)

    jac = jax.jacrev(outputs)(flat)  # (5, 2, P): jacfwd cannot
    p = jax.nn.softmax(outputs(flat))
    h = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(p) / len(y)
    ggn = jnp.einsum("nip,nij,njq->pq", jac, h, jac)
    g_out = (p - jax.nn.one_hot(y, 2, dtype=f64)) / len(y)
    grads = jnp.einsum("ni,nip->np", g_out, jac)
    empirical = len(y) * grads.T @ grads
    np.testing.assert_allclose(
        ef.ggn_operator(loss, model, (x, y)).as_matrix(), ggn, rtol=1e-12, atol=1e-14
    )
    np.testing.assert_allclose(
        ef.empirical_fisher_operator(loss, model, (x, y)).as_matrix(),
        empirical,
        rtol=1e-12,
        atol=1e-14,
    )

    # The Hessian: reverse over reverse (forward mode failed in `mv`, with JAX's
    # message alone), against `jax.jacrev` of `jax.jacrev`.
    def total(theta):
        return loss(eqx.combine(unravel(theta), static), (x, y))

    hessian = jax.jacrev(jax.jacrev(total))(flat)
    np.testing.assert_allclose(
        ef.hessian_operator(loss, model, (x, y)).as_matrix(),
        hessian,
        rtol=1e-12,
        atol=1e-14,
    )


def test_hessian_through_a_checkpointed_while_loop():
    # docs/layers.md says `hessian_operator` works where a custom rule exists
    # because the primal has no reverse mode (a checkpointed `while_loop`): it
    # failed, with JAX's "Reverse-mode differentiation does not work for
    # lax.while_loop" (`jax.linearize` splits the loop, and the custom-vjp path
    # went reverse over reverse). One JVP of the gradient per product works.
    model = mlp()
    x, y = batch_for("softmax_ce")

    def loss_fn(model, batch):
        x, y = batch
        h = eqx.internal.while_loop(
            lambda c: c[0] < 3,
            lambda c: (
                c[0] + 1,
                jnp.tanh(c[1] * model.layers[0].bias[None, : x.shape[1]]),
            ),
            (0, x),
            max_steps=5,
            kind="checkpointed",
        )[1]
        return LOSS_FNS["softmax_ce"](model, (h, y))

    flat, rebuild = ravelled(model)
    hessian = jax.jacfwd(jax.grad(lambda f: loss_fn(rebuild(f), (x, y))))(flat)
    got = ef.hessian_operator(loss_fn, model, (x, y)).as_matrix()
    np.testing.assert_allclose(got, hessian, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="Reverse-mode differentiation"):
        ef.curvature(loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.Dense())


@pytest.mark.parametrize("name", list(OPERATORS))
def test_eager_products_trace_once(name):
    # Called outside `jit`, `mv` and `as_matrix` linearised the model again at
    # every call (0.1 s each for a 73-parameter MLP, op by op). They are compiled:
    # an operator of the same shapes and `loss_fn` traces nothing new.
    traces = []

    def loss_fn(model, batch):
        traces.append(1)
        return LOSS_FNS["softmax_ce"](model, batch)

    model, batch = mlp(), batch_for("softmax_ce")
    other = jax.tree_util.tree_map(lambda a: a[::-1], batch)
    g = random_like(model, 3)
    make = OPERATORS[name][0]
    first = make(loss_fn, model, batch)
    dense, product = first.as_matrix(), first.mv(g)
    traces.clear()
    # Built for a new batch (`ggn_operator`'s check traced `loss_fn` again, 54-74
    # ms for a 32-layer MLP), then used.
    again = make(loss_fn, model, other)
    matrix, moved = again.as_matrix(), again.mv(g)
    assert traces == []
    np.testing.assert_allclose(
        matrix, reference(name, model, other, "softmax_ce"), rtol=1e-10
    )
    assert tree_allclose(moved, lx.linearise(again).mv(g), rtol=1e-12)
    flat_g, _ = jax.flatten_util.ravel_pytree(g)
    flat_product, _ = jax.flatten_util.ravel_pytree(product)
    np.testing.assert_allclose(dense @ flat_g, flat_product, rtol=1e-10)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operators_are_modules_that_compile_once(name):
    # The operators were `lineax.FunctionLinearOperator`s holding the traced product
    # as a static program: every new one passed into `eqx.filter_jit` compiled the
    # function again (0.6-1.0 s), and `jax.jit` and a scan carry refused them. Now
    # their arrays are leaves.
    loss = "softmax_ce"
    make = OPERATORS[name][0]
    model, batch = mlp(), batch_for(loss)
    other = jax.tree_util.tree_map(lambda a: a[::-1], batch)  # new values, same shapes
    g = random_like(model, 3)
    ops = [make(LOSS_FNS[loss], m, b) for m, b in [(model, batch), (model, other)]]
    assert isinstance(ops[0], ef.MatrixFreeOperator)

    @eqx.filter_jit
    def product(op, v):
        return op.mv(v)

    first = product(ops[0], g)
    assert compiled_during(lambda: product(ops[1], g)) == []
    # The same products as a linearised operator's, and as `jax.jit`'s.
    assert tree_allclose(first, lx.linearise(ops[0]).mv(g), rtol=1e-13)
    assert tree_allclose(jax.jit(lambda op, v: op.mv(v))(ops[1], g), product(ops[1], g))
    # A stack of operators, mapped over; and a `lax.scan` carrying one.
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *ops)
    mapped = jax.vmap(lambda op: op.mv(g))(stacked)
    for i, op in enumerate(ops):
        one = jax.tree_util.tree_map(lambda a, i=i: a[i], mapped)
        assert tree_allclose(one, product(op, g), rtol=1e-12)
    carried, _ = jax.lax.scan(lambda op, _: (op, None), ops[0], length=2)
    assert tree_allclose(product(carried, g), first)
    # The dense matrix, through lineax's `materialise` and `as_matrix`.
    dense = np.asarray(ops[0].as_matrix())
    # (`as_matrix` is compiled, `materialise` not: they round apart at 1e-17.)
    np.testing.assert_allclose(
        lx.materialise(ops[0]).as_matrix(), dense, rtol=1e-13, atol=1e-15
    )
    flat_g, _ = jax.flatten_util.ravel_pytree(g)
    flat_first, _ = jax.flatten_util.ravel_pytree(first)
    np.testing.assert_allclose(dense @ np.asarray(flat_g), flat_first, rtol=1e-10)
