"""eqfisher under JAX's debugging modes: `jax.debug_nans`, `jax.debug_infs`,
`jax.transfer_guard("disallow")`, `jax.disable_jit()` and
`jax.checking_leaks()` (docs/layers.md, "Under JAX's debugging modes")."""

import sys

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef

from .optim_problem import like, loss_fn, problem


def _train(model, state, step, batch, keys):
    losses = []
    for key in keys:
        model, state, loss = step(model, state, batch, key)
        losses.append(loss)
    return model, losses


def test_kfac_step_runs_under_debug_nans_infs_and_a_transfer_guard():
    """The training loop raises nothing under the modes a user debugs it with:
    no non-finite value leaves a jitted call (a failed factorisation is caught
    inside the step), and no array moves implicitly between host and device."""
    model, batch = problem()
    opt = ef.optim.kfac(0.3, like=like())
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    keys = list(jax.random.split(jax.random.key(0), 6))
    model, first = _train(model, state, step, batch, keys[:1])  # compiled here
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    with jax.debug_nans(True), jax.debug_infs(True), jax.transfer_guard("disallow"):
        _, losses = _train(model, state, step, batch, keys[1:])
    losses = np.asarray(jnp.stack(losses))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] <= float(first[0])


def test_kfac_adaptive_runs_under_debug_nans_from_its_first_step():
    # Its state's `rho` was NaN until the first adaptation, an output of every
    # step before it: `jax.debug_nans` stopped a healthy run at step 1.
    model, batch = problem()
    opt = ef.optim.kfac_adaptive(like=like(), initial_damping=1.0, adapt_every=2)
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    assert float(state.steps.rho) == 1.0
    with jax.debug_nans(True), jax.debug_infs(True):
        model, state, first = step(model, state, batch)
        for _ in range(3):
            model, state, loss = step(model, state, batch)
    assert float(loss) < float(first)
    assert np.isfinite(float(state.steps.rho)) and float(state.steps.rho) != 1.0


def test_curvature_under_disable_jit_equals_the_compiled_one():
    """Run op by op (`jax.disable_jit()`), the tracer still reads the layers from
    the jaxpr, and every structure equals the compiled computation's."""
    model, batch = problem()  # float64: the suite runs with x64 on
    for structure in (ef.Dense(), ef.KFAC()):
        compiled = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=structure
        ).as_matrix()
        with jax.disable_jit():
            eager = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=structure
            ).as_matrix()
        np.testing.assert_allclose(eager, compiled, rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(
    sys.version_info < (3, 13),
    reason="On Python < 3.13, `equinox.error_if` under `jax.checking_leaks()` "
    "reports its own stack walk as a leak (equinox#997, jax#28032), with or "
    "without eqfisher; this is checked on the newest Python in CI",
)
def test_no_tracer_leaks():
    model, batch = problem()
    with jax.checking_leaks():
        curvature = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        value, _, _ = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )(model, batch, key=jax.random.key(0))
        # The operators' shape check entered Equinox's cache with their traces.
        grads = eqx.filter(model, eqx.is_inexact_array)
        ggn = ef.ggn_operator(loss_fn, model, batch)
        product, matrix = ggn.mv(grads), ggn.as_matrix()
        hessian = ef.hessian_operator(loss_fn, model, batch).as_matrix()
    assert np.isfinite(float(curvature.trace())) and np.isfinite(float(value))
    flat = jax.flatten_util.ravel_pytree(grads)[0]
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(product)[0], matrix @ flat, rtol=1e-10
    )
    np.testing.assert_allclose(hessian, hessian.T, rtol=1e-8, atol=1e-12)
