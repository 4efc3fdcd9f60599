import functools as ft
import inspect

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfisher as ef
from eqfisher import optim

from .helpers import compiled_during, tree_allclose
from .optim_problem import VGC, like as _like, loss_fn, problem as _problem


F64 = jnp.float64


# The problem and its curvature template (optim_problem.py), the optimisers and
# their compiled steps are built once and shared: tests that use the same
# configuration reuse one compilation.
@ft.cache
def _kfac(learning_rate, **kwargs):
    """`optim.kfac` with the shared template, one object per configuration."""
    return optim.kfac(learning_rate, like=_like(), **kwargs)


@ft.cache
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
    opt = optim.kfac_preconditioner(
        like=_like(),
        damping=0.1,
        damping_variant=optim.Tikhonov(),
        norm_constraint=None,
    )
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
    opt = optim.kfac_preconditioner(like=_like(), damping=0.1, norm_constraint=None)
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
        like=_like(), damping=0.1, inverse_every=3, norm_constraint=None
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
    free = optim.kfac_preconditioner(like=_like(), damping=0.1, norm_constraint=None)
    direction, _ = free.update(grads, free.init(params), params, curvature=curv)
    lr = 0.5
    opt = optim.kfac_preconditioner(
        like=_like(), damping=0.1, norm_constraint=constraint, learning_rate=lr
    )
    got, state = opt.update(grads, opt.init(params), params, curvature=curv)
    d, g = (jax.flatten_util.ravel_pytree(t)[0] for t in (direction, grads))
    scale = min(1.0, np.sqrt(constraint / (lr**2 * float(d @ g))))
    assert (scale < 1.0) == (constraint < 1.0)
    step = jax.flatten_util.ravel_pytree(got)[0]
    np.testing.assert_allclose(step, scale * d, rtol=1e-10, atol=1e-14)
    # The step's squared length in the damped curvature's metric C (the inverse
    # of the cached one): lr² ΔᵀCΔ = c where the constraint binds.
    metric = np.linalg.inv(np.asarray(state.inverse.as_matrix()))
    length = lr**2 * float(step @ metric @ step)
    if scale < 1.0:
        np.testing.assert_allclose(length, constraint, rtol=1e-8)
    else:
        assert length <= constraint


def test_factored_damping_trains():
    model, batch = _problem()
    opt = optim.kfac(0.2, like=_like(), inverse_every=3)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = _step(opt)
    first = float(loss_fn(model, batch))
    for _ in range(30):
        model, state, _ = step(model, state, batch)
    assert float(loss_fn(model, batch)) < 0.5 * first


@pytest.mark.parametrize("decay", [0.5, 0.95])
def test_average_is_bias_corrected_mean_of_factors(decay):
    model, batch = _problem()
    opt = optim.kfac_preconditioner(like=_like(), damping=0.1, decay=decay)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)
    curvs = []
    for i in range(3):
        b = (batch[0][i * 20 : (i + 1) * 20], batch[1][i * 20 : (i + 1) * 20])
        _, grads, curv = VGC(model, b)
        curvs.append(curv)
        _, state = opt.update(grads, state, params, curvature=curv)
    # The bias-corrected EMA of 3 estimates: weights ∝ decay², decay, 1 (1/7, 2/7,
    # 4/7 at 1/2); to float64's rounding (the decay's weights were once float32).
    weights = np.array([decay**2, decay, 1.0]) / (1 + decay + decay**2)
    name = "layers[0]"
    expected = sum(w * c.blocks[name].a for w, c in zip(weights, curvs))
    np.testing.assert_allclose(
        state.curvature.blocks[name].a, expected, rtol=1e-13, atol=1e-15
    )


def test_training_reduces_loss_and_state_is_stable_under_jit():
    model, batch = _problem()
    opt = optim.kfac(0.05, like=_like(), momentum=0.5, inverse_every=3)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = _step(opt)
    first = float(loss_fn(model, batch))
    for _ in range(30):
        model, state, _ = step(model, state, batch)
    assert float(loss_fn(model, batch)) < 0.5 * first
    assert bool(optim.curvature_ok(state))


def test_nonfinite_curvature_is_rejected_and_counted():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(like=_like(), damping=0.1)
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


@pytest.mark.parametrize("value", [jnp.nan, -jnp.inf])
@pytest.mark.parametrize("factor", ["a", "g"])
def test_one_nonfinite_element_of_a_wide_or_a_small_factor_is_rejected(factor, value):
    # A factor of more than 2**18 elements (A: 601 x 601) is checked by a reduction
    # of its own, the small ones (G: 2 x 2) joined: one NaN in either is caught.
    model = eqx.nn.Linear(600, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 600))
    batch = (x, jnp.arange(16) % 2)
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    opt = optim.kfac_preconditioner(
        like=optim.curvature_like(VGC, model, batch), damping=0.1
    )
    _, state = opt.update(grads, opt.init(params), params, curvature=curv)
    (name,) = curv.blocks
    assert curv.blocks[name].a.size > 2**18 >= curv.blocks[name].g.size
    bad = eqx.tree_at(
        lambda c: getattr(c.blocks[name], factor),
        curv,
        replace_fn=lambda f: f.at[1, 1].set(value),
    )
    _, new_state = jax.jit(opt.update)(grads, state, params, curvature=bad)
    assert int(new_state.nonfinite_count) == 1
    for old, new in zip(
        jax.tree_util.tree_leaves(state.curvature),
        jax.tree_util.tree_leaves(new_state.curvature),
    ):
        np.testing.assert_array_equal(old, new)


def test_nonfinite_first_curvature_gives_no_step():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(like=_like(), damping=0.1)
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
        like=_like(),
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


def test_inject_hyperparams_changes_the_learning_rate_as_a_schedule_does():
    # optax.inject_hyperparams passes every numeric argument as an array
    # (`inverse_every`, `weight_decay` included); both used to be refused.
    model, batch = _problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    injected = optax.inject_hyperparams(optim.kfac)(
        learning_rate=0.05, like=_like(), weight_decay=1e-3
    )
    scheduled = optim.kfac(
        lambda n: jnp.where(n < 2, 0.05, 0.01),
        like=_like(),
        weight_decay=1e-3,
    )
    runs = []
    for opt in [injected, scheduled]:
        state, m = opt.init(params), model
        for i in range(4):
            if opt is injected and i == 2:
                state.hyperparams["learning_rate"] = jnp.asarray(0.01, F64)
            m, state, _ = _step(opt)(m, state, batch)
        runs.append(eqx.filter(m, eqx.is_inexact_array))
    assert tree_allclose(runs[0], runs[1], rtol=1e-12, atol=1e-14)


def test_composes_with_optax_chain_clip_and_mask():
    model, batch = _problem()
    frozen = ef.filters.optax_mask(model, ef.filters.by_path("layers[0].*"))
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optim.kfac(0.05, like=_like()),
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
        # Constants are checked here, in full: no check of them is traced per step.
        (dict(damping=float("inf")), "`damping` must be finite"),
        (dict(damping=float("nan")), "`damping` must be finite"),
        (dict(damping=1e-3, norm_constraint=float("inf")), "norm_constraint"),
        (
            dict(damping=1e-3, learning_rate=float("inf")),
            "`learning_rate` must be finite",
        ),
        (
            dict(damping=1e-3, learning_rate=jnp.asarray(jnp.nan)),
            "`learning_rate` must",
        ),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.kfac_preconditioner(like=_like(), **kwargs)


def test_like_must_be_a_curvature():
    # The runtime type check (a TypeError naming the argument) or eqfisher's own.
    with pytest.raises(TypeError, match="like"):
        optim.kfac_preconditioner(like="curvature")


@pytest.mark.parametrize("make", [optim.kfac_preconditioner, optim.kfac])
def test_damping_variant_must_be_an_instance(make, unchecked):
    # Taken as given, a string failed at `init` with an AttributeError, a class
    # with "invert() missing 1 required positional argument".
    kwargs = dict(like=_like())
    if make is optim.kfac:
        kwargs["learning_rate"] = 0.1
    with pytest.raises(TypeError, match=r"damping_variant=.*got 'pi'"):
        make(damping_variant="pi", **kwargs)
    with pytest.raises(TypeError, match=r"call it, `Tikhonov\(\)`"):
        make(damping_variant=optim.Tikhonov, **kwargs)


def test_update_with_a_curvature_unlike_the_template():
    model, batch = _problem()
    other = eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, key=jax.random.key(3))
    opt = optim.kfac_preconditioner(like=optim.curvature_like(VGC, other, batch))
    _, grads, curv = VGC(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    with pytest.raises(ValueError, match="like"):
        opt.update(grads, opt.init(params), params, curvature=curv)


def test_adaptive_kfac_chooses_steps_from_the_quadratic_model():
    model, batch = _problem()
    opt = optim.kfac_adaptive(like=_like(), initial_damping=1.0, adapt_every=2)
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


def _flat(tree):
    return jax.flatten_util.ravel_pytree(tree)[0]


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_adaptive_kfac_step_and_ratio_are_those_of_the_objective(weight_decay):
    # The objective L + η/2‖θ‖²: its curvature G + ηI in the model and the
    # inverse (the ℓ2 term used to be left out of both, and of ρ: updates 47% to
    # 460x off), and ρ against the undamped model, as Martens & Grosse and kfac_jax.
    model, batch = _problem()
    lam = 0.3
    opt = optim.kfac_adaptive(
        like=_like(), initial_damping=lam, adapt_every=1, weight_decay=weight_decay
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    q = optim.quadratic_model(loss_fn, model, batch)
    updates, state = opt.update(
        grads, opt.init(params), params, curvature=curv, quadratic=q
    )
    theta, unravel = jax.flatten_util.ravel_pytree(params)
    g = _flat(grads) + weight_decay * theta
    eye = np.eye(len(g))
    ggn = np.asarray(ef.ggn_operator(loss_fn, model, batch).as_matrix())
    delta = -np.linalg.solve(curv.as_matrix() + (lam + weight_decay) * eye, g)
    undamped = ggn + weight_decay * eye
    alpha = -(g @ delta) / (delta @ (undamped + lam * eye) @ delta)
    step = alpha * delta
    np.testing.assert_allclose(_flat(updates), step, rtol=1e-5, atol=1e-8)

    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

    def objective(t):
        loss = loss_fn(eqx.combine(unravel(t), static), batch)
        return loss + 0.5 * weight_decay * jnp.sum(t**2)

    predicted = g @ step + 0.5 * step @ undamped @ step
    rho = (objective(theta + step) - objective(theta)) / predicted
    np.testing.assert_allclose(state.steps.rho, rho, rtol=1e-4)


@pytest.mark.parametrize("grads", ["zero", "nan", "repeated"])
def test_adaptive_kfac_never_returns_a_non_finite_step(grads):
    # Δ = 0 gave α = 0/0, and a step parallel to the last one a singular 2x2
    # system: NaN updates, kept as the previous update for every later step.
    model, batch = _problem()
    opt = optim.kfac_adaptive(like=_like(), initial_damping=1.0)
    params = eqx.filter(model, eqx.is_inexact_array)
    _, g, curv = VGC(model, batch)
    q = optim.quadratic_model(loss_fn, model, batch)
    state = opt.init(params)
    bad = {
        "zero": jax.tree.map(jnp.zeros_like, g),
        "nan": jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g),
        "repeated": g,
    }[grads]
    _, state = opt.update(g, state, params, curvature=curv, quadratic=q)
    updates, state = opt.update(bad, state, params, curvature=curv, quadratic=q)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(updates))
    if grads != "repeated":  # no direction: no step
        assert all(not bool(jnp.any(x)) for x in jax.tree.leaves(updates))
    updates, state = opt.update(g, state, params, curvature=curv, quadratic=q)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(updates))
    assert any(bool(jnp.any(x)) for x in jax.tree.leaves(updates))


@pytest.mark.parametrize(
    "kwargs", [dict(adapt_every=0), dict(adapt_every=2.5), dict(weight_decay=-1.0)]
)
def test_adaptive_kfac_options_are_checked(kwargs, unchecked):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        optim.kfac_adaptive(like=_like(), **kwargs)


def test_adaptive_kfac_needs_the_quadratic_model():
    model, batch = _problem()
    opt = optim.kfac_adaptive(like=_like())
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
        optax.masked(
            optim.kfac(
                0.05,
                like=optim.curvature_like(vgc, model, batch),
                damping=1e-3,
                damping_variant=optim.Tikhonov(),
                graft=None,
            ),
            mask,
        ),
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


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        bool(jnp.array_equal(x, y, equal_nan=True)) for x, y in zip(la, lb)
    )


@ft.cache
def _kfac_train_step(opt):
    @eqx.filter_jit
    def step(params, state, batch):
        model = eqx.combine(params, STATIC)
        _, grads, curv = VGC(model, batch)
        updates, state = opt.update(grads, state, params, curvature=curv)
        return eqx.apply_updates(params, updates), state

    return step


STATIC = eqx.partition(_problem()[0], eqx.is_inexact_array)[1]


@pytest.mark.parametrize(
    "make",
    [
        lambda: _kfac(0.1),
        lambda: _kfac(0.1, momentum=0.9, weight_decay=1e-3),
        lambda: optim.kfac_preconditioner(
            like=_like(), damping_variant=optim.Tikhonov()
        ),
    ],
)
def test_state_structure_is_fixed_from_init(make):
    model, batch = _problem()
    opt = make()
    params = eqx.filter(model, eqx.is_inexact_array)
    state0 = opt.init(params)
    step = _kfac_train_step(opt)
    state = state0
    for _ in range(3):
        params, state = step(params, state, batch)
        assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(
            state0
        )
        assert [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state)] == [
            (x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state0)
        ]


def test_scan_of_five_steps_equals_the_python_loop_and_compiles_once():
    model, batch = _problem()
    opt = optim.kfac(0.1, like=_like(), inverse_every=2)
    params = eqx.filter(model, eqx.is_inexact_array)
    traces = []

    def body(carry, _):
        traces.append(1)  # runs once per trace, not per step
        p, s = carry
        _, grads, curv = VGC(eqx.combine(p, STATIC), batch)
        updates, s = opt.update(grads, s, p, curvature=curv)
        return (eqx.apply_updates(p, updates), s), None

    step = eqx.filter_jit(lambda carry: body(carry, None)[0])
    carry = (params, opt.init(params))
    for _ in range(5):
        carry = step(carry)
    assert len(traces) == 1  # one trace for five steps: the state kept its structure
    scanned = eqx.filter_jit(lambda c: jax.lax.scan(body, c, None, length=5)[0])(
        (params, opt.init(params))
    )
    assert tree_allclose(scanned, carry, rtol=1e-10, atol=1e-12)


def test_init_makes_the_states_zeros_in_one_program():
    """Called eagerly, `init` compiles one program for all the averages' and
    inverses' zeros, not one for each factor shape (a model of shapes no other
    test uses, so that none is cached)."""
    model = eqx.nn.MLP(5, 3, 13, 2, activation=jnp.tanh, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (8, 5))
    batch = (x, jnp.arange(8) % 3)
    like = optim.curvature_like(VGC, model, batch)
    opt = optim.kfac(0.1, like=like, graft=None)
    params = eqx.filter(model, eqx.is_inexact_array)
    compiled = compiled_during(lambda: opt.init(params))
    assert [c for c in compiled if "_zeros_of" in c] != []
    assert [c for c in compiled if "broadcast_in_dim" in c] == [], compiled
    state = opt.init(params)
    assert all(not bool(jnp.any(x)) for x in jax.tree_util.tree_leaves(state))


def test_trained_state_loads_into_a_fresh_init(tmp_path):
    model, batch = _problem()
    opt = _kfac(0.1, momentum=0.9, weight_decay=1e-3)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = _kfac_train_step(opt)
    state = opt.init(params)
    for _ in range(4):
        params, state = step(params, state, batch)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, state)
    loaded = eqx.tree_deserialise_leaves(path, opt.init(params))
    assert _leaves_equal(loaded, state)
    # And training continues from it exactly as from the original.
    assert _leaves_equal(step(params, loaded, batch), step(params, state, batch))


def _dense_kfac(block):
    return np.kron(np.asarray(block.g), np.asarray(block.a))


@pytest.mark.parametrize("lam", [1e-3, 0.3])
def test_damping_variants_equal_their_definitions(lam):
    model, batch = _problem()
    _, _, curv = VGC(model, batch)
    for block in curv.blocks.values():
        a, g = np.asarray(block.a), np.asarray(block.g)
        dense = block.as_matrix()
        # Tikhonov: (B + λI)⁻¹, B the dense Kronecker matrix in operand order.
        exact = np.linalg.inv(np.asarray(dense) + lam * np.eye(dense.shape[0]))
        got = optim.Tikhonov().precompute(block, jnp.asarray(lam)).as_matrix()
        np.testing.assert_allclose(got, exact, rtol=1e-8, atol=1e-10)
        # π-damping: (G + (√λ/π)I)⁻¹ ⊗ (A + π√λI)⁻¹, π² = (tr A/d_A) / (tr G/d_G).
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
        inv_a = np.linalg.inv(a + pi * np.sqrt(lam) * np.eye(a.shape[0]))
        inv_g = np.linalg.inv(g + np.sqrt(lam) / pi * np.eye(g.shape[0]))
        got = optim.FactoredTikhonov().precompute(block, jnp.asarray(lam))
        np.testing.assert_allclose(got.a, inv_a, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(got.g, inv_g, rtol=1e-8, atol=1e-10)
        v = tuple(
            jax.random.normal(jax.random.key(7), s.shape, s.dtype)
            for s in block.structure
        )
        np.testing.assert_allclose(
            jax.flatten_util.ravel_pytree(block.solve_factored(v, lam))[0],
            jax.flatten_util.ravel_pytree(got.mv(v))[0],
            rtol=1e-10,
            atol=1e-12,
        )


def test_pi_damped_inverse_of_a_zero_block_is_finite():
    model, batch = _problem()
    _, _, curv = VGC(model, batch)
    block = curv.blocks["layers[0]"]
    zero = jax.tree_util.tree_map(jnp.zeros_like, block)
    inverse = zero.pi_damped_inverse(0.01)  # π falls back to 1: (√λ)⁻¹I ⊗ (√λ)⁻¹I
    np.testing.assert_allclose(inverse.a, 10 * np.eye(block.a.shape[0]), rtol=1e-12)
    np.testing.assert_allclose(inverse.g, 10 * np.eye(block.g.shape[0]), rtol=1e-12)


class _Scanned(eqx.Module):
    first: eqx.nn.Linear
    stack: eqx.nn.Linear  # three steps of one layer, stacked
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.first = eqx.nn.Linear(3, 20, dtype=F64, key=k1)
        make = lambda k: eqx.nn.Linear(20, 20, dtype=F64, key=k)  # noqa: E731
        self.stack = eqx.filter_vmap(make)(jax.random.split(k2, 3))
        self.head = eqx.nn.Linear(20, 2, dtype=F64, key=k3)

    def __call__(self, x):
        params, static = eqx.partition(self.stack, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        h, _ = jax.lax.scan(body, jnp.tanh(self.first(x)), params)
        return self.head(h)


@pytest.mark.parametrize("max_inverse_dim", [256, 8])
@pytest.mark.parametrize("max_factor_dim", [None, 10])
def test_factored_inverse_of_all_blocks_at_once_equals_block_by_block(
    max_factor_dim, max_inverse_dim
):
    # `FactoredTikhonov.invert` inverts the K-FAC blocks' factors by size class,
    # each padded with an identity block to its class's size (21, 20, 4, 2 here,
    # and a stacked layer's steps, vmapped): the same as block by block, in float64.
    x = jax.random.normal(jax.random.key(2), (32, 3), F64)
    batch = (x, (x[:, 0] > 0).astype(jnp.int32))
    model = _Scanned(jax.random.key(0))
    curv = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.KFAC(max_factor_dim=max_factor_dim),
    )
    assert curv.runs  # the stacked layer's steps are one stored block
    damping = optim.FactoredTikhonov(max_inverse_dim=max_inverse_dim)
    for lam in (1e-3, 0.3):
        together = damping.invert(curv, jnp.asarray(lam, F64))
        one_by_one = curv.map_blocks(lambda b, lam=lam: damping.precompute(b, lam))
        assert jax.tree.structure(together) == jax.tree.structure(one_by_one)
        for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(one_by_one)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_wide_factors_are_inverted_as_their_block_diagonal():
    # FactoredTikhonov(max_inverse_dim=8): the 21-wide input factors (the stacked
    # layer's and the head's) are inverted as three 7-wide diagonal blocks, each
    # shifted by the whole factor's π√λ; factors of at most 8 whole. By hand, in
    # float64, for the plain and the stacked block, through the optimiser's update.
    x = jax.random.normal(jax.random.key(2), (32, 3), F64)
    batch = (x, (x[:, 0] > 0).astype(jnp.int32))
    model = _Scanned(jax.random.key(0))
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    lam = jnp.asarray(1e-2, F64)
    damping = optim.FactoredTikhonov(max_inverse_dim=8)
    inverse = damping.invert(curv, lam)

    def by_hand(block):
        shift_a, shift_g = block.pi_damping_shifts(lam)
        a = jnp.zeros_like(block.a)
        for s in (0, 7, 14):
            piece = block.a[s : s + 7, s : s + 7] + shift_a * jnp.eye(7, dtype=F64)
            a = a.at[s : s + 7, s : s + 7].set(jnp.linalg.inv(piece))
        eye = jnp.eye(block.g.shape[0], dtype=F64)
        g = jnp.linalg.inv(block.g + shift_g * eye) if block.g.shape[0] <= 8 else None
        return a, g

    head, got = curv.stored["head"], inverse.stored["head"]
    a, g = by_hand(head)
    np.testing.assert_allclose(got.a, a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got.g, g, rtol=1e-10, atol=1e-12)
    stack, got = curv.stored["stack[0]"], inverse.stored["stack[0]"]
    for i in range(3):
        step = jax.tree.map(lambda x, i=i: x[i], stack)
        a, _ = by_hand(step)
        np.testing.assert_allclose(got.a[i], a, rtol=1e-10, atol=1e-12)
        # G (20 wide) too: 7, 7 and 6.
        shift_g = step.pi_damping_shifts(lam)[1]
        for s, n in ((0, 7), (7, 7), (14, 6)):
            piece = step.g[s : s + n, s : s + n] + shift_g * jnp.eye(n, dtype=F64)
            np.testing.assert_allclose(
                got.g[i, s : s + n, s : s + n], jnp.linalg.inv(piece), rtol=1e-10
            )
        assert not jnp.any(got.g[i, :7, 7:])
    # The optimiser preconditions with it.
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, _ = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.KFAC()
    )(model, batch)
    pre = optim.kfac_preconditioner(
        like=curv, damping=1e-2, damping_variant=damping, norm_constraint=None
    )
    direction, _ = pre.update(grads, pre.init(params), params, curvature=curv)
    expected = inverse.mv(grads)
    for u, v in zip(jax.tree.leaves(direction), jax.tree.leaves(expected)):
        np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)
    whole = optim.FactoredTikhonov(max_inverse_dim=None).invert(curv, lam)
    assert not np.allclose(whole.stored["head"].a, inverse.stored["head"].a)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "256"])
def test_max_inverse_dim_must_be_a_positive_integer_or_none(bad):
    # Values are the library's check; other types are also refused by the runtime
    # type check where it is on (the tests), with a TypeError.
    error = ValueError if isinstance(bad, int) else (ValueError, TypeError)
    with pytest.raises(error, match="max_inverse_dim"):
        optim.FactoredTikhonov(max_inverse_dim=bad)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nonfinite_guard_keeps_parameters_finite_on_a_nan_batch(momentum):
    model, batch = _problem()
    # The configurations of test_state_structure_is_fixed_from_init (shared steps).
    opt = _kfac(0.1) if momentum == 0 else _kfac(0.1, momentum=0.9, weight_decay=1e-3)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = _kfac_train_step(opt)
    state = opt.init(params)
    params, state = step(params, state, batch)
    bad = (batch[0].at[3].set(jnp.nan), batch[1])  # NaN statistics and gradients
    before = params
    params, state = step(params, state, bad)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    if momentum == 0:
        assert _leaves_equal(params, before)  # no step (momentum alone moves on)
    kstate = optim.find_kfac_state(state)
    assert int(kstate.nonfinite_count) == 1 and int(kstate.skipped_count) == 1
    params, state = step(params, state, batch)  # and training goes on
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    assert not _leaves_equal(params, before)


def _after_one_estimate(jit):
    """`(opt, update, grads, params, curv, state, doubled)`: `kfac`'s update
    (jitted or not) and its state after one curvature estimate, and that
    curvature doubled (a second estimate that changes the average)."""
    model, batch = _problem()
    _, grads, curv = VGC(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = optim.kfac(0.1, like=_like())
    update = eqx.filter_jit(opt.update) if jit else opt.update
    _, state = update(grads, opt.init(params), params, curvature=curv)
    doubled = jax.tree.map(lambda x: 2 * x, curv)
    return opt, update, grads, params, curv, state, doubled


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_curvature_due_false_is_the_update_without_curvature(jit):
    # `curvature_due=False` marks `curvature=` as a placeholder (what kfac_step
    # passes between estimates, so that the update is traced once): the update
    # and the state are those of an update without curvature; True is an estimate.
    opt, update, grads, params, curv, state, doubled = _after_one_estimate(jit)
    zeros = jax.tree.map(jnp.zeros_like, curv)
    want = update(grads, state, params)
    got = update(
        grads, state, params, curvature=zeros, curvature_due=jnp.asarray(False)
    )
    assert _leaves_equal(got, want)
    due = update(
        grads, state, params, curvature=doubled, curvature_due=jnp.asarray(True)
    )
    assert _leaves_equal(due, update(grads, state, params, curvature=doubled))
    assert int(optim.find_kfac_state(due[1]).curvature_count) == 2
    # A placeholder before any estimate has nothing to precondition with.
    error = eqx.EquinoxRuntimeError if jit else ValueError
    with pytest.raises(error, match="no curvature estimate given"):
        update(
            grads,
            opt.init(params),
            params,
            curvature=zeros,
            curvature_due=jnp.asarray(False),
        )
    with pytest.raises(ValueError, match="curvature_due=.*needs `curvature=`"):
        opt.update(grads, state, params, curvature_due=jnp.asarray(True))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_curvature_function_is_called_where_it_is_due(jit):
    # `curvature=` may be a function returning the curvature (what kfac_step
    # passes): it is called inside the `cond` on `curvature_due`, and the update is
    # exactly the one given the curvature itself.
    _, update, grads, params, _, state, doubled = _after_one_estimate(jit)
    calls = []

    def estimate():
        calls.append(1)
        return doubled

    assert _leaves_equal(
        update(grads, state, params, curvature=estimate),
        update(grads, state, params, curvature=doubled),
    )
    for due in (True, False):
        got = update(
            grads, state, params, curvature=estimate, curvature_due=jnp.asarray(due)
        )
        want = (
            update(grads, state, params, curvature=doubled)
            if due
            else update(grads, state, params)
        )
        assert _leaves_equal(got, want)
        count = optim.find_kfac_state(got[1]).curvature_count
        assert int(count) == (2 if due else 1)
    assert calls  # traced (or run) by the update, not before it


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_int_curvature_due_is_a_period_by_the_states_count(jit):
    # `curvature_due=k` (what kfac_step passes): an estimate at every k-th update
    # by the K-FAC state's own count, from the first; the same updates and states
    # as the boolean `count % k == 0`, and no update before an estimate to check.
    model, batch = _problem()
    _, grads, curv = VGC(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = optim.kfac(0.1, like=_like())
    update = eqx.filter_jit(opt.update) if jit else opt.update
    by_int = by_bool = opt.init(params)
    for n in range(5):
        estimate = jax.tree.map(lambda x, n=n: (1 + n) * x, curv)
        got = update(grads, by_int, params, curvature=estimate, curvature_due=3)
        want = update(
            grads,
            by_bool,
            params,
            curvature=estimate,
            curvature_due=jnp.asarray(n % 3 == 0),
        )
        assert _leaves_equal(got, want)
        by_int, by_bool = got[1], want[1]
    assert int(optim.find_kfac_state(by_int).curvature_count) == 2  # n = 0 and 3
    # A Python bool is a boolean, not a period of 1 or 0.
    same = update(grads, by_int, params, curvature=curv, curvature_due=False)
    assert _leaves_equal(same, update(grads, by_int, params))
    for bad in (0, -2, np.int64(0)):
        with pytest.raises(ValueError, match=r"curvature_due=.*k >= 1, got"):
            opt.update(grads, by_int, params, curvature=curv, curvature_due=bad)
    # A NumPy integer is a period too (outside jit, where it is not traced); an
    # integer array is refused, not read as a truth value.
    by_np = opt.update(grads, by_int, params, curvature=curv, curvature_due=np.int64(3))
    by_py = opt.update(grads, by_int, params, curvature=curv, curvature_due=3)
    assert _leaves_equal(by_np, by_py)
    for bad in (jnp.asarray(2), jnp.asarray([True])):
        with pytest.raises(TypeError, match=r"curvature_due=.*boolean scalar"):
            opt.update(grads, by_int, params, curvature=curv, curvature_due=bad)


def test_amortised_steps_reuse_the_cached_inverse():
    model, batch = _problem()
    opt = optim.kfac(0.1, like=_like(), inverse_every=1)
    calls, traces = [], []

    def counted_loss(model, batch):
        traces.append(1)  # once per trace of the step, not per call
        return loss_fn(model, batch)

    step = optim.kfac_step(
        counted_loss,
        opt,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        curvature_update_period=3,
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    inverses, traced = [], []
    for _ in range(7):
        model, state, loss = step(model, state, batch)
        traced.append(len(traces))
        kstate = optim.find_kfac_state(state)
        calls.append(int(kstate.curvature_count))
        inverses.append(kstate.inverse)
    # Statistics at steps 0, 3, 6; the inverse is recomputed only then.
    assert calls == [1, 1, 1, 2, 2, 2, 3]
    assert int(kstate.refresh_count) == 3 and int(kstate.count) == 7
    assert _leaves_equal(inverses[1], inverses[0])
    assert _leaves_equal(inverses[2], inverses[0])
    assert not _leaves_equal(inverses[3], inverses[2])
    # The step was traced (so compiled) once: no call after the first traced it.
    assert traced[0] > 0 and traced == [traced[0]] * 7


def test_kfac_step_equals_the_hand_written_step():
    model, batch = _problem()
    opt = _kfac(0.1)
    step = optim.kfac_step(
        loss_fn,
        opt,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        curvature_update_period=1,
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    by_hand = _kfac_train_step(opt)
    state = opt.init(params)
    m, s = model, state
    p, t = params, state
    for _ in range(3):
        m, s, _ = step(m, s, batch)
        p, t = by_hand(p, t, batch)
    assert tree_allclose(eqx.filter(m, eqx.is_inexact_array), p, rtol=1e-12)


def test_kfac_step_passes_the_loss_to_transformations_that_read_it():
    # `optax.contrib.reduce_on_plateau` reads `value=`; kfac_step did not pass
    # it (a TypeError), although the docs say it works with chains.
    model, batch = _problem()
    plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    opt = optax.chain(_kfac(0.1), plateau)
    step = optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax's plateau mixes dtypes
        for _ in range(3):
            model, state, loss = step(model, state, batch)
            losses.append(float(loss))
    plateau_state = state[1]
    assert float(plateau_state.best_value) == min(losses)


def test_curvature_batch_size_names_a_scalar_leaf():
    model, (x, y) = _problem()
    step = optim.kfac_step(
        lambda m, b: loss_fn(m, b[:2]),
        _kfac(0.1),
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        curvature_batch_size=4,
    )
    state = _kfac(0.1).init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(ValueError, match=r"leaf at `batch\[2\]` is a scalar"):
        step(model, state, (x, y, jax.random.key(0)))
    # A leaf that is no array at all (the static half of `eqx.partition`): said so.
    with pytest.raises(
        ValueError, match=r"`batch\[2\]` is not an array \(PjitFunction"
    ):
        step(model, state, (x, y, jnp.tanh))
    # A table shared by every example (a noise schedule) was cut to its first rows
    # too, silently: the curvature of another loss.
    with pytest.raises(ValueError, match=r"leading sizes differ .*`batch\[2\]`: 3"):
        step(model, state, (x, y, jnp.ones(3)))


def test_curvature_from_a_sub_batch():
    model, batch = _problem()
    opt = optim.kfac_preconditioner(like=_like(), norm_constraint=None)
    step = optim.kfac_step(
        loss_fn,
        opt,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        curvature_batch_size=16,
    )
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    new, state, _ = step(model, state, batch)
    # The statistics are the sub-batch's, the gradient the whole batch's.
    _, _, sub = VGC(model, (batch[0][:16], batch[1][:16]))
    grads = eqx.filter_grad(loss_fn)(model, batch)
    kstate = optim.find_kfac_state(state)
    for name, block in sub.blocks.items():
        np.testing.assert_allclose(kstate.curvature.blocks[name].a, block.a, atol=1e-12)
        np.testing.assert_allclose(kstate.curvature.blocks[name].g, block.g, atol=1e-12)
    moved = jax.tree.map(
        lambda a, b: a - b,
        eqx.filter(new, eqx.is_inexact_array),
        eqx.filter(model, eqx.is_inexact_array),
    )
    expected = kstate.inverse.mv(grads)  # the bare preconditioner: +C⁻¹g
    assert tree_allclose(moved, expected, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("period", [0, 1.5])
def test_bad_curvature_update_period(period):
    with pytest.raises((TypeError, ValueError), match="curvature_update_period"):
        optim.kfac_step(
            loss_fn,
            optim.kfac(0.1, like=_like()),
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            curvature_update_period=period,
        )


def test_default_period_gives_statistics_every_second_step():
    model, batch = _problem()
    opt = _kfac(0.1)
    step = optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    counts = []
    for _ in range(5):
        model, state, _ = step(model, state, batch)
        counts.append(int(optim.find_kfac_state(state).curvature_count))
    assert optim.CURVATURE_UPDATE_PERIOD == 2
    assert counts == [1, 1, 2, 2, 3]


class _TinyCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=k1)
        self.out = eqx.nn.Linear(2 * 4 * 4, 3, key=k2)

    def __call__(self, x):
        return self.out(jnp.tanh(self.conv(x)).reshape(-1))


def _cnn_problem():
    model = _TinyCNN(jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (16, 1, 4, 4))
    y = jax.random.randint(jax.random.key(5), (16,), 0, 3)
    return model, (x, y)


@pytest.mark.parametrize("make", [_problem, _cnn_problem], ids=["mlp", "cnn"])
def test_amortised_kfac_step_equals_the_hand_written_loop(make):
    # With period 3, steps 0, 3, 6 fold in the curvature, the others only
    # precondition. On CPU the MLP's statistics steps take the loss and gradient
    # from the statistics pass (inside the `cond`), the CNN's from a gradient
    # outside it; both must equal the hand-written loop.
    model, batch = make()
    estimator, structure = ef.GGN(), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    traces = []

    def counted_loss(model, batch):
        traces.append(1)  # once per trace of the step, not per call
        return loss_fn(model, batch)

    step = optim.kfac_step(
        counted_loss,
        opt,
        estimator=estimator,
        structure=structure,
        curvature_update_period=3,
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    state = by_hand_state = opt.init(params)
    by_hand = model
    traced = []
    for i in range(7):
        model, state, loss = step(model, state, batch)
        traced.append(len(traces))
        value, grads, curv = vgc(by_hand, batch)
        extra = {"curvature": curv} if i % 3 == 0 else {}
        p = eqx.filter(by_hand, eqx.is_inexact_array)
        updates, by_hand_state = opt.update(grads, by_hand_state, p, **extra)
        by_hand = eqx.apply_updates(by_hand, updates)
        np.testing.assert_allclose(loss, value, rtol=1e-12)
    assert tree_allclose(
        eqx.filter(model, eqx.is_inexact_array),
        eqx.filter(by_hand, eqx.is_inexact_array),
        rtol=1e-10,
        atol=1e-12,
    )
    assert int(optim.find_kfac_state(state).curvature_count) == 3
    assert traced[0] > 0 and traced == [traced[0]] * 7  # traced (compiled) once


def test_signatures_show_the_measured_defaults():
    # The public signatures write the defaults out (the API reference shows them);
    # they must be the measured defaults eqfisher.optim exports (chosen by the
    # grids in benchmarks/RESULTS.md).
    chosen = {
        ef.optim.kfac_preconditioner: {
            "damping": optim.DAMPING,
            "inverse_every": optim.INVERSE_EVERY,
            "norm_constraint": optim.NORM_CONSTRAINT,
            "damping_variant": optim.PI_DAMPING,
        },
        ef.optim.kfac: {
            "damping": optim.GRAFTED_DAMPING,
            "inverse_every": optim.GRAFTED_INVERSE_EVERY,
            "momentum": optim.MOMENTUM,
            "norm_constraint": None,
            "damping_variant": optim.PI_DAMPING,
        },
        ef.optim.kfac_step: {"curvature_update_period": optim.CURVATURE_UPDATE_PERIOD},
    }
    for fn, defaults in chosen.items():
        parameters = inspect.signature(fn).parameters
        for name, value in defaults.items():
            assert parameters[name].default == value, (fn.__name__, name)
    graft = inspect.signature(ef.optim.kfac).parameters["graft"].default
    assert isinstance(graft, optax.GradientTransformation)
    # `optax.scale_by_adam()`: its state is Adam's.
    assert isinstance(graft.init({"w": jnp.zeros(2)}), optax.ScaleByAdamState)


def test_the_model_passed_for_params_is_refused_naming_the_filter():
    model, batch = _problem()
    opt = optim.kfac(0.1, like=_like())
    with pytest.raises(TypeError, match=r"init\(params\)`.*eqx.filter\(model"):
        opt.init(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, curv = VGC(model, batch)
    with pytest.raises(TypeError, match=r"update\(updates, state, params\)`"):
        opt.update(grads, opt.init(params), model, curvature=curv)


@pytest.mark.parametrize(
    "make",
    [
        lambda like: optim.kfac(0.1, like=like),
        lambda like: optim.kfac(0.1, like=like, inverse_every=2, momentum=0.9),
        lambda like: optim.kfac_preconditioner(like=like),
    ],
)
def test_an_eager_update_compiles_nothing_after_the_first(make):
    # Called outside `jit`, as the README's loop does, every update compiled its
    # `lax.cond`s (new closures each call) and the host inverse's callback (a new
    # `functools.partial`) again: 0.2-0.7 s an update. Concrete conditions now
    # take their branch, and the callback is one object per shapes.
    model, batch = _problem()
    opt = make(_like())
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)
    for _ in range(2):  # the refresh and the amortised branches, compiled
        _, grads, curv = VGC(model, batch)
        _, state = opt.update(grads, state, params, curvature=curv)
    _, grads, curv = VGC(model, batch)
    assert (
        compiled_during(lambda: opt.update(grads, state, params, curvature=curv)) == []
    )
    # The same update as compiled.
    eager = opt.update(grads, state, params, curvature=curv)
    jitted = eqx.filter_jit(opt.update)(grads, state, params, curvature=curv)
    assert tree_allclose(eager, jitted, rtol=1e-12, atol=1e-14)
