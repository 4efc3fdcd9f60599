import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfisher as ef
from eqfisher import optim


def _problem():
    key = jax.random.key(0)
    model = eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=key)
    w = jax.random.normal(jax.random.key(1), (3, 2))
    x = jax.random.normal(jax.random.key(2), (64, 3))
    y = jnp.argmax(x @ w, axis=-1)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


VGC = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())


def _step(opt):
    @eqx.filter_jit
    def step(model, state, batch):
        loss, grads, curv = VGC(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = opt.update(grads, state, params, curvature=curv)
        return eqx.apply_updates(model, updates), state, loss

    return step


def test_first_update_is_damped_natural_gradient():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(damping=0.1, damping_mode="exact")
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    direction, state = opt.update(grads, opt.init(params), params, curvature=curv)
    expected = curv.solve(grads, 0.1)
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(
            lambda a, b: jnp.allclose(a, b, atol=1e-12), direction, expected
        )
    )
    assert int(state.count) == 1 and int(state.nonfinite_count) == 0


def test_factored_damping_is_the_pi_damped_solve():
    model, batch = _problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    opt = optim.kfac_preconditioner(damping=0.1)  # "factored" is the default
    direction, state = opt.update(grads, opt.init(params), params, curvature=curv)
    leaves = jax.tree_util.tree_leaves(grads)
    got = jax.tree_util.tree_leaves(direction)
    for name, idx in curv.leaf_indices:
        block = curv.blocks[name]
        expected = block.solve_factored(tuple(leaves[i] for i in idx), 0.1)
        for i, e in zip(idx, expected):
            np.testing.assert_allclose(got[i], e, rtol=1e-9, atol=1e-12)
    # Between refreshes the cached inverses are reused: with inverse_every=3, the
    # direction of step 5 uses the inverse of the average at step 4.
    opt = optim.kfac_preconditioner(
        damping=0.1, damping_mode="factored", inverse_every=3
    )
    state = opt.init(params)
    for _ in range(4):
        _, state = opt.update(grads, state, params, curvature=curv)
    name = "layers[0]"
    cached = state.inverse.blocks[name].a
    _, new_state = opt.update(grads, state, params, curvature=curv)
    np.testing.assert_array_equal(new_state.inverse.blocks[name].a, cached)


@pytest.mark.parametrize("constraint", [1e-6, 1e6])
def test_norm_constraint_bounds_the_step_in_the_curvature_metric(constraint):
    model, batch = _problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    free = optim.kfac_preconditioner(damping=0.1)
    direction, _ = free.update(grads, free.init(params), params, curvature=curv)
    lr = 0.5
    opt = optim.kfac_preconditioner(
        damping=0.1, norm_constraint=constraint, learning_rate=lr
    )
    got, _ = opt.update(grads, opt.init(params), params, curvature=curv)
    d, g = (jax.flatten_util.ravel_pytree(t)[0] for t in (direction, grads))
    scale = min(1.0, np.sqrt(constraint / (lr**2 * float(d @ g))))
    assert (scale < 1.0) == (constraint < 1.0)
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(got)[0], scale * d, rtol=1e-10, atol=1e-14
    )


def test_factored_damping_trains():
    model, batch = _problem()
    opt = optim.kfac(0.2, damping=1e-2, damping_mode="factored", inverse_every=3)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = _step(opt)
    first = float(loss_fn(model, batch))
    for _ in range(30):
        model, state, _ = step(model, state, batch)
    assert float(loss_fn(model, batch)) < 0.5 * first


def test_average_is_bias_corrected_mean_of_factors():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(damping=0.1, decay=0.5)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)
    curvs = []
    for i in range(3):
        b = (batch[0][i * 20 : (i + 1) * 20], batch[1][i * 20 : (i + 1) * 20])
        _, grads, curv = VGC(model, b)
        curvs.append(curv)
        _, state = opt.update(grads, state, params, curvature=curv)
    # Bias-corrected EMA with decay 1/2 over 3 estimates: weights 1/7, 2/7, 4/7.
    name = "layers[0]"
    expected = sum(w * c.blocks[name].a for w, c in zip((1 / 7, 2 / 7, 4 / 7), curvs))
    np.testing.assert_allclose(state.curvature.blocks[name].a, expected, atol=1e-12)


def test_training_reduces_loss_and_state_is_stable_under_jit():
    model, batch = _problem()
    opt = optim.kfac(0.05, damping=1e-2, momentum=0.5, inverse_every=3)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = _step(opt)
    first = float(loss_fn(model, batch))
    for _ in range(30):
        model, state, _ = step(model, state, batch)
    assert float(loss_fn(model, batch)) < 0.5 * first
    assert bool(optim.curvature_ok(state))


def test_nonfinite_curvature_is_rejected_and_counted():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(damping=0.1)
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    _, state = opt.update(grads, opt.init(params), params, curvature=curv)
    bad = jax.tree_util.tree_map(lambda x: x * jnp.nan, curv)
    direction, new_state = opt.update(grads, state, params, curvature=bad)
    assert int(new_state.nonfinite_count) == 1
    for old, new in zip(
        jax.tree_util.tree_leaves(state.curvature),
        jax.tree_util.tree_leaves(new_state.curvature),
    ):
        np.testing.assert_array_equal(old, new)
    assert all(
        bool(jnp.all(jnp.isfinite(d))) for d in jax.tree_util.tree_leaves(direction)
    )
    assert not bool(optim.curvature_ok((new_state,)))


def test_nonfinite_first_curvature_gives_no_step():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(damping=0.1)
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    bad = jax.tree_util.tree_map(lambda x: x * jnp.inf, curv)
    direction, state = opt.update(grads, opt.init(params), params, curvature=bad)
    assert int(state.nonfinite_count) == 1
    assert all(bool(jnp.all(d == 0)) for d in jax.tree_util.tree_leaves(direction))


def test_schedules_and_serialisation(tmp_path):
    model, batch = _problem()
    opt = optim.kfac(
        optax.linear_schedule(0.05, 0.01, 10),
        damping=optax.exponential_decay(1e-1, 5, 0.5),
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = _step(opt)
    for _ in range(4):
        model, state, _ = step(model, state, batch)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, state)
    like = jax.tree_util.tree_map(jnp.zeros_like, state)
    loaded = eqx.tree_deserialise_leaves(path, like)
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: jnp.array_equal(a, b), state, loaded)
    )


def test_composes_with_optax_chain_clip_and_mask():
    model, batch = _problem()
    frozen = ef.filters.optax_mask(model, ef.filters.by_path("layers[0].*"))
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optim.kfac(0.05),
        optax.masked(optax.set_to_zero(), frozen),
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    new, state, _ = _step(opt)(model, state, batch)
    assert jnp.array_equal(new.layers[0].weight, model.layers[0].weight)
    assert not jnp.array_equal(new.layers[1].weight, model.layers[1].weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(damping=0.0), "damping"),
        (dict(damping=-1.0), "damping"),
        (dict(damping=1e-3, decay=1.0), "decay"),
        (dict(damping=1e-3, decay=-0.1), "decay"),
        (dict(damping=1e-3, inverse_every=0), "inverse_every"),
        (dict(damping=1e-3, norm_constraint=0.0), "norm_constraint"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.kfac_preconditioner(**kwargs)


def test_bad_damping_mode():
    # The runtime type check (a TypeError) or eqfisher's own ValueError, both
    # naming the argument.
    with pytest.raises((TypeError, ValueError), match="damping_mode"):
        optim.kfac_preconditioner(damping=1e-3, damping_mode="pi")


def test_update_without_curvature():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(damping=0.1)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = eqx.filter_grad(loss_fn)(model, batch)
    with pytest.raises(ValueError, match="curvature="):
        opt.update(grads, opt.init(params), params)


def test_adaptive_kfac_chooses_steps_from_the_quadratic_model():
    model, batch = _problem()
    opt = optim.kfac_adaptive(initial_damping=1.0, adapt_every=2)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)

    @eqx.filter_jit
    def step(model, state):
        _, grads, curv = VGC(model, batch)
        q = optim.quadratic_model(loss_fn, model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = opt.update(grads, state, params, curvature=curv, quadratic=q)
        return eqx.apply_updates(model, updates), state, grads, curv

    first = float(loss_fn(model, batch))
    # The first step is α·Δ with α minimising the damped quadratic model along Δ.
    new, state1, grads, curv = step(model, state)
    delta = jax.tree_util.tree_map(jnp.negative, curv.solve(grads, 1.0))
    q = optim.quadratic_model(loss_fn, model, batch)
    gd = sum(
        jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(delta))
    )
    dd = sum(jnp.sum(d * d) for d in jax.tree.leaves(delta))
    alpha = -gd / (q.gram([delta])[0, 0] + 1.0 * dd)
    moved = jax.tree_util.tree_map(
        lambda a, b: a - b,
        eqx.filter(new, eqx.is_inexact_array),
        eqx.filter(model, eqx.is_inexact_array),
    )
    for m, d in zip(jax.tree.leaves(moved), jax.tree.leaves(delta)):
        np.testing.assert_allclose(m, alpha * d, rtol=1e-8, atol=1e-12)
    model, state = new, state1
    for _ in range(20):
        model, state, _, _ = step(model, state)
    assert float(loss_fn(model, batch)) < 0.5 * first
    assert float(state.steps.damping) != 1.0  # Levenberg–Marquardt moved it
    assert bool(jnp.isfinite(state.steps.rho))


def test_adaptive_kfac_needs_the_quadratic_model():
    model, batch = _problem()
    opt = optim.kfac_adaptive()
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    with pytest.raises(ValueError, match="quadratic"):
        opt.update(grads, opt.init(params), params, curvature=curv)


def test_kfac_on_a_where_subset_inside_optax_masked():
    model, batch = _problem()
    where = ef.filters.by_path("layers[1].*")
    mask = ef.filters.optax_mask(model, where)
    vgc = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), where=where
    )
    opt = optax.chain(
        optax.masked(optim.kfac(0.05, damping_mode="exact"), mask),
        optax.masked(optax.sgd(0.1), jax.tree_util.tree_map(lambda m: not m, mask)),
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)
    _, grads, curv = vgc(model, batch)
    updates, state = opt.update(grads, state, params, curvature=curv)
    sgd = -0.1 * eqx.filter_grad(loss_fn)(model, batch).layers[0].weight
    np.testing.assert_allclose(updates.layers[0].weight, sgd, atol=1e-12)
    direction = curv.solve(eqx.filter(grads, mask), 1e-3)
    np.testing.assert_allclose(
        updates.layers[1].weight, -0.05 * direction.layers[1].weight, atol=1e-12
    )
