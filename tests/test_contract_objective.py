"""One objective: the curvature is that of the value `loss_fn` returns.

Constant factors, weighted sums, batch weights and vmapped registrations weight each
registered loss's curvature; nonlinear dependence and parameter terms outside the
registered losses are refused. References: dense float64 GGNs from `jax.jacfwd` and
`jax.hessian` (tests/helpers.py), never eqfisher.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import block_slices, dense_ggn, dense_hessian, tree_allclose


def _model():
    m = eqx.nn.MLP(3, 5, 4, 1, activation=jnp.tanh, key=jr.key(0))
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, m
    )


def _batch(n=6):
    x = jr.normal(jr.key(1), (n, 3), jnp.float64)
    t = jr.normal(jr.key(2), (n, 2), jnp.float64)
    y = jnp.arange(n) % 3
    w = jnp.asarray(2.5, jnp.float64)
    return x, t, y, w


def _mse(out, t):
    return jnp.mean(0.5 * jnp.sum((out - t) ** 2, axis=-1))


def _ce(out, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], -1))


# name -> (loss_fn, loss of the model outputs for the reference)
CASES = {
    "scaled": (
        lambda m, b: 8.0 * ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1]),
        lambda o, b: 8.0 * _mse(o[:, :2], b[1]),
    ),
    "weighted_sum": (
        lambda m, b: (
            ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1])
            + 0.1 * ef.softmax_cross_entropy(jax.vmap(m)(b[0])[:, 2:], b[2])
        ),
        lambda o, b: _mse(o[:, :2], b[1]) + 0.1 * _ce(o[:, 2:], b[2]),
    ),
    "batch_weight": (
        lambda m, b: b[3] * ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1]) / 3,
        lambda o, b: b[3] * _mse(o[:, :2], b[1]) / 3,
    ),
    "two_halves": (
        lambda m, b: (
            0.5 * ef.squared_error(jax.vmap(m)(b[0][:2])[:, :2], b[1][:2])
            + 2.0 * ef.squared_error(jax.vmap(m)(b[0][2:])[:, :2], b[1][2:])
        ),
        lambda o, b: 0.5 * _mse(o[:2, :2], b[1][:2]) + 2.0 * _mse(o[2:, :2], b[1][2:]),
    ),
    "vmapped_sum": (
        lambda m, b: jnp.sum(
            jax.vmap(lambda x, t: ef.squared_error(m(x)[None, :2], t[None]))(b[0], b[1])
        ),
        lambda o, b: o.shape[0] * _mse(o[:, :2], b[1]),
    ),
    # `jnp.stack` is a primitive from jax 0.10 on (was refused as nonlinear).
    "stacked_mean": (
        lambda m, b: jnp.mean(
            jnp.stack(
                [
                    ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1]),
                    ef.softmax_cross_entropy(jax.vmap(m)(b[0])[:, 2:], b[2]),
                ]
            )
        ),
        lambda o, b: 0.5 * (_mse(o[:, :2], b[1]) + _ce(o[:, 2:], b[2])),
    ),
    "scan_outputs_mean": (
        lambda m, b: jnp.mean(_scanned_losses(jax.vmap(m)(b[0]), b[1])),
        lambda o, b: 0.5 * (_mse(o[:, :2], b[1]) + _mse(o[:, 2:4], b[1])),
    ),
}


def _scanned_losses(out, t):
    """Two losses registered by a `lax.scan` over two output groups, returned as
    its stacked outputs."""
    groups = jnp.stack([out[:, :2], out[:, 2:4]])

    def step(carry, o):
        return carry, ef.squared_error(o, t)

    return jax.lax.scan(step, None, groups)[1]


def _reference(case, model, batch):
    _, loss_of_outputs = CASES[case]
    return dense_ggn(
        lambda m: jax.vmap(m)(batch[0]), lambda o: loss_of_outputs(o, batch), model
    )


def _block_diagonal(dense, model):
    out = np.zeros_like(dense)
    sl = block_slices(model)
    for layer in (sl[0:2], sl[2:4]):
        s = slice(layer[0].start, layer[-1].stop)
        out[s, s] = dense[s, s]
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "structure", [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal()], ids=repr
)
def test_exact_structures_weight_each_loss(case, structure):
    model, batch = _model(), _batch()
    loss_fn = CASES[case][0]
    # Losses on parts of the batch have no per-example split of the batch: their
    # exact curvature comes from full-batch products.
    examples = (
        ef.InteractingExamples() if case == "two_halves" else ef.IndependentExamples()
    )
    got = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=structure,
        examples=examples,
    )
    ref = _reference(case, model, batch)
    if isinstance(structure, ef.BlockDiagonal):
        ref = _block_diagonal(ref, model)
    elif isinstance(structure, ef.Diagonal):
        ref = np.diag(np.diag(ref))
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["scaled", "weighted_sum", "batch_weight"])
@pytest.mark.parametrize("structure", [ef.KFAC(), ef.EKFAC()], ids=repr)
def test_kronecker_structures_weight_each_loss(case, structure):
    # With one example, K-FAC's and EKFAC's blocks are the exact GGN blocks.
    model, batch = _model(), _batch(1)
    got = ef.curvature(
        CASES[case][0], model, batch, estimator=ef.GGN(), structure=structure
    )
    ref = _block_diagonal(_reference(case, model, batch), model)
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_ggn_operator_and_value_grad_and_curvature(case):
    model, batch = _model(), _batch()
    loss_fn = CASES[case][0]
    ref = _reference(case, model, batch)
    op = ef.ggn_operator(loss_fn, model, batch)
    np.testing.assert_allclose(op.as_matrix(), ref, rtol=1e-10, atol=1e-12)
    examples = (
        ef.InteractingExamples() if case == "two_halves" else ef.IndependentExamples()
    )
    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.Dense(), examples=examples
    )
    value, grads, curv = eqx.filter_jit(vgc)(model, batch)
    np.testing.assert_allclose(value, loss_fn(model, batch), rtol=1e-12)
    assert tree_allclose(grads, eqx.filter_grad(loss_fn)(model, batch))
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


def test_empirical_fisher_is_scaled():
    model, batch = _model(), _batch()
    loss_fn = CASES["scaled"][0]
    base = lambda m, b: ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1])
    got = ef.empirical_fisher_operator(loss_fn, model, batch).as_matrix()
    curv = ef.curvature(
        loss_fn, model, batch, estimator=ef.EmpiricalFisher(), structure=ef.Dense()
    )
    # Σₙ wₙ ∇ℓₙ ∇ℓₙᵀ with wₙ = 8/N, from per-example gradients.
    flat, unravel = jax.flatten_util.ravel_pytree(
        eqx.filter(model, eqx.is_inexact_array)
    )
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

    def one(f, x, t):
        m = eqx.combine(unravel(f), static)
        return 0.5 * jnp.sum((m(x)[:2] - t) ** 2)

    g = jax.vmap(jax.grad(one), (None, 0, 0))(flat, batch[0], batch[1])
    ref = 8.0 / g.shape[0] * g.T @ g
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)
    assert base(model, batch) * 8 == pytest.approx(loss_fn(model, batch))


def test_loss_tags_hvp_is_the_weighted_hessian():
    model, batch = _model(), _batch()
    loss_fn = CASES["weighted_sum"][0]
    params = eqx.filter(model, eqx.is_inexact_array)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    losses, hv = ef.loss_tags_hvp(loss_fn)(model, batch, v)
    ref = dense_hessian(lambda m: loss_fn(m, batch), model)
    flat_v, _ = jax.flatten_util.ravel_pytree(v)
    flat_hv, _ = jax.flatten_util.ravel_pytree(hv)
    np.testing.assert_allclose(flat_hv, ref @ flat_v, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose([float(loss.coefficient) for loss in losses], [1, 0.1])


def _penalty(m):
    return 0.5 * sum(
        jnp.sum(p**2)
        for p in jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_inexact_array))
    )


def _loss(m, b):
    return ef.squared_error(jax.vmap(m)(b[0])[:, :2], b[1])


@pytest.mark.parametrize("structure", [ef.Dense(), ef.KFAC(), ef.Diagonal()], ids=repr)
def test_penalty_inside_loss_fn_is_refused(structure):
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match=r"layers\[0\].weight.*stop_hessian"):
        ef.curvature(
            lambda m, b: _loss(m, b) + 1e-2 * _penalty(m),
            model,
            batch,
            estimator=ef.GGN(),
            structure=structure,
        )
    with pytest.raises(ValueError, match="other than through its registered losses"):
        ef.ggn_operator(lambda m, b: _loss(m, b) + 1e-2 * _penalty(m), model, batch)


def test_penalty_with_stop_hessian_keeps_its_gradient_and_drops_its_curvature():
    model, batch = _model(), _batch()

    def loss_fn(m, b):
        return _loss(m, b) + 1e-2 * ef.stop_hessian(_penalty)(m)

    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.Dense())
    value, grads, curv = vgc(model, batch)
    np.testing.assert_allclose(value, _loss(model, batch) + 1e-2 * _penalty(model))
    expected = eqx.filter_grad(lambda m, b: _loss(m, b) + 1e-2 * _penalty(m))(
        model, batch
    )
    assert tree_allclose(grads, expected)
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0]), lambda o: _mse(o[:, :2], batch[1]), model
    )
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


def test_penalty_as_damping_is_the_exact_gauss_newton_of_the_whole_objective():
    # The documented way out for ½λ‖θ‖²: its Hessian λI goes into the damping.
    model, batch = _model(), _batch()
    lam = 1e-2
    curv = ef.curvature(_loss, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0]), lambda o: _mse(o[:, :2], batch[1]), model
    )
    ref = ref + lam * np.eye(ref.shape[0])
    full = dense_hessian(lambda m: _loss(m, batch) + lam * _penalty(m), model)
    # The Hessian of the penalty is exactly λI: the GGN parts agree.
    loss_h = dense_hessian(lambda m: _loss(m, batch), model)
    np.testing.assert_allclose(full - loss_h, lam * np.eye(ref.shape[0]), atol=1e-12)
    params = eqx.filter(model, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    got = jax.flatten_util.ravel_pytree(curv.solve(params, lam))[0]
    np.testing.assert_allclose(got, np.linalg.solve(ref, flat), rtol=1e-8)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda m, b: jnp.log(_loss(m, b)),
        lambda m, b: _loss(m, b) ** 2,
        lambda m, b: _loss(m, b) * _loss(m, b),
        lambda m, b: jax.lax.cond(True, lambda v: v, lambda v: 2 * v, _loss(m, b)),
    ],
    ids=["log", "square", "product", "cond"],
)
def test_nonlinear_dependence_is_refused(loss_fn):
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match="nonlinearly"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())


def _chosen(m, b):
    # A registered loss chosen by `lax.cond`: the registrations are in its branches.
    out = jax.vmap(m)(b[0])[:, :2]
    return jax.lax.cond(
        b[3] > 0,
        lambda o: ef.squared_error(o, b[1]),
        lambda o: 2.0 * ef.squared_error(o, b[1]),
        out,
    )


def _plus_chosen(m, b):
    out = jax.vmap(m)(b[0])[:, :2]
    extra = jax.lax.cond(
        b[3] > 0, lambda o: 0.5 * ef.squared_error(o, b[1]), lambda o: 0.0, out
    )
    return ef.squared_error(out, b[1]) + extra


def _weighted_by_the_condition(m, b):  # the fix the refusal gives
    out = jax.vmap(m)(b[0])[:, :2]
    w = jnp.where(b[3] > 0, 1.0, 0.0)
    return w * ef.squared_error(out, b[1]) + (1 - w) * 2.0 * ef.squared_error(out, b[1])


@pytest.mark.parametrize("loss_fn", [_chosen, _plus_chosen], ids=["only", "extra"])
def test_a_loss_registered_inside_control_flow_is_refused_as_such(loss_fn):
    # Was "registers no loss. Compute the loss with eqfisher.squared_error, ..."
    # (what the user did) or "a penalty or regulariser".
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match=r"registers a loss inside `cond`.*jnp.where"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    curv = ef.curvature(
        _weighted_by_the_condition,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.Dense(),
    )
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0])[:, :2], lambda o: _mse(o, batch[1]), model
    )
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)


def test_a_coefficient_that_depends_on_parameters_is_refused():
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match="other than through its registered losses"):
        ef.curvature(
            lambda m, b: (1 + _penalty(m)) * _loss(m, b),
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.Diagonal(),
        )


def test_stop_gradient_normalisation_is_a_constant_factor():
    # loss / stop_gradient(loss) has Hessian H / loss: the coefficient is 1/loss.
    model, batch = _model(), _batch()
    loss_fn = lambda m, b: _loss(m, b) / jax.lax.stop_gradient(_loss(m, b))
    got = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
    scale = 1 / _loss(model, batch)
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0]),
        lambda o: scale * _mse(o[:, :2], batch[1]),
        model,
    )
    np.testing.assert_allclose(got.as_matrix(), ref, rtol=1e-10, atol=1e-12)


def test_negative_coefficient_is_refused():
    """A constant coefficient (`-loss`) is known while tracing and refused then,
    a `ValueError`; one the batch gives, at run time (Equinox's error)."""
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match="negative coefficient"):
        ef.curvature(
            lambda m, b: -_loss(m, b),
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
        )
    weight = jnp.asarray(-2.0, jnp.float64)
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative coefficient"):
        ef.curvature(
            lambda m, b: b[-1] * _loss(m, b[:-1]),
            model,
            (*batch, weight),
            estimator=ef.GGN(),
            structure=ef.KFAC(),
        ).as_matrix().block_until_ready()


def test_a_loss_only_in_aux_adds_no_curvature():
    model, batch = _model(), _batch()

    def loss_fn(m, b):
        out = jax.vmap(m)(b[0])
        extra = ef.softmax_cross_entropy(out[:, 2:], b[2])
        return ef.squared_error(out[:, :2], b[1]), extra

    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.Dense(), has_aux=True
    )
    (_, extra), _, curv = vgc(model, batch)
    ref = dense_ggn(
        lambda m: jax.vmap(m)(batch[0]), lambda o: _mse(o[:, :2], batch[1]), model
    )
    np.testing.assert_allclose(curv.as_matrix(), ref, rtol=1e-10, atol=1e-12)
    assert np.isfinite(extra)
