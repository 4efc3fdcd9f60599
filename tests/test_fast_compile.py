"""`kfac_step(fast_compile=...)` and `optim.fast_compile_options()`: the same step
with other XLA compiler options, at the top level and inside another trace."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqfisher as ef
from eqfisher import optim

from .helpers import tree_allclose
from .optim_problem import like, loss_fn, problem


def _step(fast_compile):
    opt = optim.kfac(0.1, like=like())
    step = optim.kfac_step(
        loss_fn,
        opt,
        estimator=ef.GGN(),
        structure=ef.KFAC(),
        curvature_update_period=2,
        fast_compile=fast_compile,
    )
    return opt, step


def _train(step, opt, n=4):
    model, batch = problem()
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(n):
        model, state, loss = step(model, state, batch)
        losses.append(loss)
    return eqx.filter(model, eqx.is_inexact_array), state, jnp.stack(losses)


def test_options_compile_and_compute_the_same():
    options = optim.fast_compile_options()
    assert isinstance(options, dict)
    assert all(isinstance(k, str) for k in options)
    if jax.default_backend() != "cpu":
        assert options == {}
    x = jnp.linspace(-1.0, 1.0, 7)
    f = eqx.filter_jit(lambda x: jnp.tanh(x) * x**2, compiler_options=options or None)
    assert jnp.allclose(f(x), jnp.tanh(x) * x**2, rtol=1e-12, atol=1e-14)


def test_fast_and_default_compiles_train_alike():
    fast = _train(*reversed(_step(True)))
    default = _train(*reversed(_step(False)))
    # Other element-wise code, the same arithmetic: equal to float64 rounding.
    assert tree_allclose(fast, default, rtol=1e-9, atol=1e-12)
    assert fast[2][-1] < fast[2][0]


def test_fast_step_inside_jit_scan_and_a_closure():
    opt, step = _step(True)
    model, batch = problem()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = opt.init(params)
    reference = _train(step, opt, n=2)

    # Inside a scan: the arguments are tracers, the plain jit is used.
    def body(carry, _):
        p, s = carry
        m, s, loss = step(eqx.combine(p, static), s, batch)
        return (eqx.filter(m, eqx.is_inexact_array), s), loss

    (p, s), losses = eqx.filter_jit(lambda c: jax.lax.scan(body, c, None, length=2))(
        (params, state)
    )
    assert tree_allclose((p, s, losses), reference, rtol=1e-9, atol=1e-12)

    # Inside a jit that closes over concrete arrays: no tracer among the
    # arguments, and jax refuses the options on the nested jit; the plain one runs.
    def closed():
        m, s2, loss = step(model, state, batch)
        return eqx.filter(m, eqx.is_inexact_array), s2, loss

    out = eqx.filter_jit(closed)()
    first = _train(step, opt, n=1)
    assert tree_allclose(out[:2], first[:2], rtol=1e-9, atol=1e-12)
    assert tree_allclose(out[2], first[2][0], rtol=1e-9, atol=1e-12)


def test_fast_compile_must_be_a_bool():
    opt = optim.kfac(0.1, like=like())
    with pytest.raises(TypeError, match="fast_compile"):
        optim.kfac_step(
            loss_fn,
            opt,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            fast_compile="yes",  # pyright: ignore[reportArgumentType]
        )


def test_options_are_found_inside_a_trace_too():
    from eqfisher.optim import _compile

    _compile._cpu_options.cache_clear()  # so the first call, inside a jit, probes
    inside = []
    jax.jit(lambda x: (inside.append(optim.fast_compile_options()), x)[1])(1.0)
    assert inside == [optim.fast_compile_options()]
