"""`kfac_step(fast_compile=...)` and `optim.fast_compile_options()`: the same step
with other XLA compiler options, at the top level and inside another trace."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef
from eqfisher import optim
from eqfisher._host_linalg import usable_cores

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


def test_the_llvm_module_is_compiled_in_four_parts_a_core(monkeypatch):
    from eqfisher.optim import _compile

    key = "xla_cpu_parallel_codegen_split_count"
    try:
        for cores, parts in ((1, 4), (2, 8), (5, 20), (64, 32)):
            monkeypatch.setattr(_compile, "usable_cores", lambda cores=cores: cores)
            _compile._cpu_options.cache_clear()
            # Taken by jaxlib 0.9-0.12's CPU compiler, with -O1.
            options = dict(_compile._cpu_options())
            assert options[key] == parts
            assert options["xla_backend_optimization_level"] == 1
    finally:
        monkeypatch.undo()
        _compile._cpu_options.cache_clear()
    if jax.default_backend() == "cpu":
        assert optim.fast_compile_options()[key] == min(32, 4 * usable_cores())


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


@pytest.mark.parametrize("flag", ["fast_compile", "donate"])
@pytest.mark.parametrize("value", ["yes", 1])
def test_flags_must_be_bools(flag, value):
    opt = optim.kfac(0.1, like=like())
    with pytest.raises(TypeError, match=flag):
        optim.kfac_step(
            loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC(), **{flag: value}
        )


def test_options_are_found_inside_a_trace_too():
    from eqfisher.optim import _compile

    _compile._cpu_options.cache_clear()  # so the first call, inside a jit, probes
    inside = []
    jax.jit(lambda x: (inside.append(optim.fast_compile_options()), x)[1])(1.0)
    assert inside == [optim.fast_compile_options()]


def test_the_step_jit_traces_arrays_and_keeps_other_leaves_static():
    from eqfisher.optim._compile import filter_jit_with_options

    traces = []

    def fun(model, batch, scale=1.0, *, key=None):
        traces.append(None)
        out = scale * model.weight @ batch[0] + batch[1]
        return out, model, scale, key

    jitted = filter_jit_with_options(fun, optim.fast_compile_options())
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    x = jnp.arange(3.0)
    batch = (x, np.float64(0.5))  # a NumPy scalar is an array leaf, as in filter_jit
    out, back, scale, key = jitted(model, batch, 2.0, key=None)
    assert jnp.allclose(out, 2.0 * model.weight @ x + 0.5, rtol=1e-12)
    # The model comes back whole: arrays through the jit, the rest as it was.
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(model)
    assert tree_allclose(back, model, rtol=0, atol=0)
    assert scale == 2.0 and isinstance(scale, float) and key is None
    # Other arrays of the same shapes: no new trace; another Python scalar: one.
    other = eqx.tree_at(lambda m: m.weight, model, 2 * model.weight)
    jitted(other, (x + 1, np.float64(1.5)), 2.0, key=None)
    assert len(traces) == 1
    again, *_ = jitted(model, batch, 3.0, key=None)
    assert len(traces) == 2
    assert jnp.allclose(again, 3.0 * model.weight @ x + 0.5, rtol=1e-12)
    # It matches equinox's own filter_jit.
    reference = eqx.filter_jit(fun)(model, batch, 3.0)
    assert tree_allclose(again, reference[0], rtol=1e-12, atol=0)


class _Indexed(eqx.Module):
    """An MLP with an integer array beside its weights: returned unchanged."""

    mlp: eqx.nn.MLP
    order: jax.Array

    def __call__(self, x):
        return self.mlp(x[self.order])


def _copied(tree):
    """`tree` with every array copied: a donated step deletes what it is given."""
    return jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)


def _indexed_loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def test_donated_steps_train_as_undonated_and_free_the_old_arrays():
    mlp, batch = problem()
    # A copy: `problem()` is cached, and the donated steps delete what they get.
    model = _Indexed(_copied(mlp), jnp.arange(3)[::-1])
    params = eqx.filter(model, eqx.is_inexact_array)
    vgc = ef.value_grad_and_curvature(
        _indexed_loss, estimator=ef.GGN(), structure=ef.KFAC()
    )
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    runs = {}
    for donate in (False, True):
        step = optim.kfac_step(
            _indexed_loss,
            opt,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            curvature_update_period=2,
            donate=donate,
        )
        # A fresh state holds one zero array in several leaves: copied, not
        # donated twice.
        m = _copied(model)
        state = opt.init(params)
        for _ in range(4):
            before = (m, state)
            m, state, loss = step(m, state, batch)
            old = jax.tree_util.tree_leaves(eqx.filter(before, eqx.is_array))
            assert all(x.is_deleted() for x in old) == donate
            # The batch is never donated.
            assert not any(x.is_deleted() for x in batch)
        runs[donate] = (eqx.filter(m, eqx.is_array), state, loss)
    assert tree_allclose(runs[True], runs[False], rtol=1e-12, atol=1e-14)
    assert jnp.array_equal(runs[True][0].order, jnp.arange(3)[::-1])


def test_a_donated_step_takes_arrays_that_share_a_buffer():
    # `jax.device_put` of a tree holding one array in several leaves (a fresh
    # K-FAC state's five counters were one array) gives several arrays on one
    # buffer: the donated step raised "Attempt to donate the same buffer twice",
    # and crashed the process on two devices.
    mlp, batch = problem()
    model = _copied(mlp)
    params = eqx.filter(model, eqx.is_inexact_array)
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=ef.KFAC())
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    state = opt.init(params)
    counters = optim.find_kfac_state(state)[:5]
    assert len({id(c) for c in counters}) == 5
    # One array in two leaves, then two arrays on one buffer.
    kfac_state = optim.find_kfac_state(state)
    state = eqx.tree_at(
        lambda s: optim.find_kfac_state(s).skipped_count, state, kfac_state.count
    )
    state = jax.device_put(state, jax.devices()[0])
    kfac_state = optim.find_kfac_state(state)
    assert kfac_state.count is not kfac_state.skipped_count
    step = optim.kfac_step(
        loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC(), donate=True
    )
    for _ in range(2):
        model, state, loss = step(model, state, batch)
    assert jnp.isfinite(loss)


def test_the_step_lowers_and_traces_ahead_of_time():
    opt, step = _step(True)
    model, batch = problem()
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    traced = step.trace(model, state, batch)
    primitives = {e.primitive.name for e in traced.jaxpr.jaxpr.eqns}
    assert "cond" in primitives  # the statistics' one `lax.cond`, at the top
    compiled = step.lower(model, state, batch).compile()
    # The statistics are chosen by one conditional, compiled once.
    assert compiled.as_text().count(" conditional(") >= 1
    # Compiling ahead of time leaves the step as it was.
    _, _, losses = _train(step, opt, n=2)
    assert jnp.all(jnp.isfinite(losses))
