import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfisher as ef
from eqfisher import optim

from .helpers import tree_allclose
from .optim_problem import VGC, like, loss_fn, problem


def _batches(n):
    """`n` batches of the problem's data, shuffled differently: the gradients and
    curvatures change from step to step, and so do Adam's moments."""
    _, (x, y) = problem()
    order = [jax.random.permutation(jax.random.key(10 + i), 64)[:32] for i in range(n)]
    return [(x[o], y[o]) for o in order]


def test_graft_rescales_each_leaf_to_the_magnitudes_length():
    # Three updates, written out by hand: the preconditioner's direction for each
    # leaf, times the norm of Adam's update for that leaf over the direction's.
    model, _ = problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    pre = optim.kfac_preconditioner(like=like(), damping=0.1, norm_constraint=None)
    adam = optax.scale_by_adam()
    opt = optim.graft(pre, adam)
    state = opt.init(params)
    pre_state, adam_state = pre.init(params), adam.init(params)
    for batch in _batches(3):
        _, grads, curv = VGC(model, batch)
        updates, state = opt.update(grads, state, params, curvature=curv)
        d, pre_state = pre.update(grads, pre_state, params, curvature=curv)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            m, adam_state = adam.update(grads, adam_state, params)
        expected = jax.tree.map(
            lambda d, m: d * jnp.linalg.norm(m) / jnp.linalg.norm(d), d, m
        )
        assert tree_allclose(updates, expected, rtol=1e-12, atol=0)
        for u, a in zip(jax.tree.leaves(updates), jax.tree.leaves(m)):
            np.testing.assert_allclose(
                jnp.linalg.norm(u), jnp.linalg.norm(a), rtol=1e-12
            )
    assert isinstance(state, optim.GraftState)
    assert int(optim.find_kfac_state(state).curvature_count) == 3


def test_kfac_is_the_grafted_preconditioner_times_the_learning_rate():
    # What `kfac`'s docstring says it is, at its defaults and with `graft=None`.
    model, _ = problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    lr = 0.03
    by_parts = {
        "grafted": optax.chain(
            optim.graft(
                optim.kfac_preconditioner(
                    like=like(),
                    damping=optim.GRAFTED_DAMPING,
                    inverse_every=optim.GRAFTED_INVERSE_EVERY,
                    norm_constraint=None,
                ),
                optax.scale_by_adam(),
            ),
            optax.scale_by_learning_rate(lr),
        ),
        "plain": optax.chain(
            # The norm constraint bounds the step after the learning rate.
            optim.kfac_preconditioner(
                like=like(),
                damping=optim.GRAFTED_DAMPING,
                inverse_every=optim.GRAFTED_INVERSE_EVERY,
                learning_rate=lr,
            ),
            optax.scale_by_learning_rate(lr),
        ),
    }
    whole = {
        "grafted": optim.kfac(lr, like=like()),
        "plain": optim.kfac(lr, like=like(), graft=None, norm_constraint=1e-2),
    }
    for name in by_parts:
        a, b = whole[name], by_parts[name]
        sa, sb = a.init(params), b.init(params)
        for batch in _batches(3):
            _, grads, curv = VGC(model, batch)
            ua, sa = a.update(grads, sa, params, curvature=curv)
            with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
                ub, sb = b.update(grads, sb, params, curvature=curv)
            assert tree_allclose(ua, ub, rtol=1e-12, atol=0), name


def test_nonfinite_gradients_leave_the_magnitude_state_alone():
    model, batch = problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = optim.kfac(0.03, like=like())
    _, grads, curv = VGC(model, batch)
    _, state = opt.update(grads, opt.init(params), params, curvature=curv)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
    updates, new_state = opt.update(bad, state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    graft_state = new_state[0]
    assert isinstance(graft_state, optim.GraftState)
    assert tree_allclose(graft_state.magnitude, state[0].magnitude, rtol=0, atol=0)
    assert int(optim.find_kfac_state(new_state).skipped_count) == 1
    # And training goes on from there.
    updates, _ = opt.update(grads, new_state, params, curvature=curv)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
    assert any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))


def test_a_zero_direction_gets_no_step():
    # Before the first finite curvature K-FAC gives no direction: grafting must
    # not turn Adam's length into a step along nothing (0 / 0).
    model, batch = problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = optim.kfac(0.03, like=like())
    _, grads, curv = VGC(model, batch)
    bad = jax.tree.map(lambda x: x * jnp.inf, curv)
    updates, state = opt.update(grads, opt.init(params), params, curvature=bad)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(optim.find_kfac_state(state).nonfinite_count) == 1


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_nonfinite_direction_anywhere_gets_no_step(bad):
    # A direction holding NaN or inf in one leaf: no leaf steps, and nothing
    # non-finite comes out (the magnitude, Adam's, is finite throughout).
    model, batch = problem()
    params = eqx.filter(model, eqx.is_inexact_array)
    _, grads, _ = VGC(model, batch)

    def spoilt(updates, state, params=None):
        del params
        first = jax.tree.leaves(updates)[0]
        return eqx.tree_at(lambda u: jax.tree.leaves(u)[0], updates, first * bad), state

    direction = optax.GradientTransformation(lambda p: optax.EmptyState(), spoilt)
    opt = optim.graft(direction, optax.scale_by_adam())
    updates, _ = eqx.filter_jit(opt.update)(grads, opt.init(params), params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    # Without it, every leaf steps Adam's length.
    direction = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
    )
    opt = optim.graft(direction, optax.scale_by_adam())
    updates, _ = opt.update(grads, opt.init(params), params)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        adam, _ = optax.scale_by_adam().update(
            grads, optax.scale_by_adam().init(params)
        )
    for u, a in zip(jax.tree.leaves(updates), jax.tree.leaves(adam)):
        assert np.isclose(float(jnp.linalg.norm(u)), float(jnp.linalg.norm(a)))


def test_grafted_kfac_trains_in_a_scan_with_one_state_structure():
    model, batch = problem()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = optim.kfac(0.03, like=like())
    step = optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state0 = opt.init(params)

    def body(carry, _):
        p, s = carry
        m, s, loss = step(eqx.combine(p, static), s, batch)
        return (eqx.filter(m, eqx.is_inexact_array), s), loss

    (params, state), losses = jax.lax.scan(body, (params, state0), None, length=20)
    assert jax.tree.structure(state) == jax.tree.structure(state0)
    assert float(losses[-1]) < 0.5 * float(losses[0])


def test_graft_and_norm_constraint_are_refused_together():
    with pytest.raises(ValueError, match="norm_constraint"):
        optim.kfac(0.03, like=like(), norm_constraint=1e-2)


def test_graft_must_be_a_transformation(unchecked):
    del unchecked
    with pytest.raises(TypeError, match="graft"):
        optim.kfac(0.03, like=like(), graft="adam")  # pyright: ignore[reportArgumentType]


def test_the_default_flat_adam_magnitude_takes_the_same_steps():
    # `kfac`'s default magnitude, `flatten_if_small(optax.scale_by_adam())`, keeps
    # this small model's Adam moments as one vector (fewer kernels, docs/optim.md):
    # the same element-wise arithmetic as Adam per leaf, so the same steps, with a
    # state of another structure.
    model, _ = problem()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    runs = []
    for graft in ({"graft": optax.scale_by_adam()}, {}):
        opt = optim.kfac(0.03, like=like(), **graft)
        state = opt.init(params)
        p = params
        for batch in _batches(4):
            _, grads, curv = VGC(eqx.combine(p, static), batch)
            updates, state = opt.update(grads, state, p, curvature=curv)
            p = eqx.apply_updates(p, updates)
        runs.append((p, state))
    (p_leaf, s_leaf), (p_flat, s_flat) = runs
    assert tree_allclose(p_flat, p_leaf, rtol=1e-12, atol=1e-14)
    moments = s_flat[0].magnitude  # Adam's state, its moments flat vectors
    assert jnp.ndim(moments.mu) == 1
    assert jax.tree.structure(s_flat) != jax.tree.structure(s_leaf)


def test_graft_takes_leaves_of_different_float_widths():
    # A bfloat16 and a float32 leaf (under the suite's strict dtype promotion):
    # each steps in its own dtype, at Adam's length for that leaf.
    params = {
        "half": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.bfloat16),
        "single": jnp.linspace(1.0, 2.0, 4, dtype=jnp.float32),
    }
    grads = jax.tree.map(lambda p: (2 * p).astype(p.dtype), params)
    direction = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
    )
    opt = optim.graft(direction, optax.scale_by_adam())
    updates, _ = opt.update(grads, opt.init(params), params)
    assert updates["half"].dtype == jnp.bfloat16
    assert updates["single"].dtype == jnp.float32
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        adam, _ = optax.scale_by_adam().update(
            grads, optax.scale_by_adam().init(params)
        )
    for name in params:
        got = float(jnp.linalg.norm(updates[name].astype(jnp.float32)))
        want = float(jnp.linalg.norm(adam[name].astype(jnp.float32)))
        assert np.isclose(got, want, rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("large", [70_001, 2**20], ids=["packed", "per-leaf"])
def test_graft_lengths_are_exact_for_leaves_of_awkward_sizes(dtype, large):
    # Every leaf's norm comes from one packed reduction over rows of a shared
    # width (nine leaves, 64 wide here: over 2048 rows of 32), or above 2**20
    # elements in all (or for one leaf) from a sum per leaf: sizes below,
    # at and above a row, an empty leaf, a scalar
    # and a leaf wider than all others must each still step exactly Adam's
    # length for that leaf.
    sizes = [(), (0,), (1,), (31,), (32,), (33,), (7, 5), (large,), (3, 4, 5)]
    params = {
        f"p{i}": jax.random.normal(jax.random.key(i), s, dtype)
        for i, s in enumerate(sizes)
    }
    grads = jax.tree.map(lambda p: (p + 1).astype(p.dtype), params)
    # A direction other than the gradient, so that the scale is not 1.
    direction = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x**3, u), s),
    )
    opt = optim.graft(direction, optax.scale_by_adam())
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        adam, _ = optax.scale_by_adam().update(
            grads, optax.scale_by_adam().init(params)
        )
    rtol = 1e-12 if dtype == jnp.float64 else 1e-5
    for name in params:
        u = np.asarray(updates[name], np.float64)
        d = np.asarray(grads[name], np.float64) ** 3
        m = np.asarray(adam[name], np.float64)
        if d.size == 0:
            assert u.shape == (0,)
            continue
        np.testing.assert_allclose(
            u, d * np.linalg.norm(m) / np.linalg.norm(d), rtol=rtol, atol=0
        )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_graft_keeps_the_magnitude_in_float32_for_half_precision(dtype):
    # Gradients of 1e-3: in float16 Adam's second moment (1e-3 * g**2) and its
    # eps of 1e-8 underflow to zero, so Adam's own step is NaN and a graft onto
    # it gave no step at all. The magnitude runs in float32 instead.
    params = {"w": jnp.full((5, 3), 0.5, dtype), "b": jnp.zeros((3,), dtype)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, dtype), params)
    direction = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
    )
    opt = optim.graft(direction, optax.scale_by_adam())
    state = opt.init(params)
    for leaf in jax.tree.leaves(state.magnitude):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    updates, state = opt.update(grads, state, params)
    for leaf in jax.tree.leaves(state.magnitude):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        adam, _ = optax.scale_by_adam().update(wide, optax.scale_by_adam().init(wide))
    for name in params:
        assert updates[name].dtype == dtype
        got = float(jnp.linalg.norm(updates[name].astype(jnp.float32)))
        want = float(jnp.linalg.norm(adam[name]))
        assert want > 1.0  # Adam's first step: about 1 an element
        np.testing.assert_allclose(got, want, rtol=1e-2)


def test_kfac_trains_a_float16_model_at_its_defaults():
    # The default `kfac` (grafted onto Adam) on float16 parameters: it moved no
    # parameter in 100 steps, and no counter said so.
    x = jax.random.normal(jax.random.key(0), (64, 8))
    y = jnp.argmax(x @ jax.random.normal(jax.random.key(1), (8, 3)), -1)
    model = eqx.nn.MLP(
        8, 3, 16, 1, activation=jnp.tanh, key=jax.random.key(2), dtype=jnp.float16
    )
    batch = (x.astype(jnp.float16), y)

    def loss(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    curv = ef.curvature(loss, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    opt = optim.kfac(1e-2, like=curv)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = optim.kfac_step(loss, opt, estimator=ef.GGN(), structure=ef.KFAC())
    first = None
    for i in range(30):
        model, state, value = step(model, state, batch, jax.random.key(i))
        first = float(value) if first is None else first
    assert jnp.isfinite(value)
    assert float(value) < 0.5 * first
