"""`flatten_if_small`: a transformation's state as one vector for a small model,
the same updates as over the leaves."""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from eqfisher import optim

from .helpers import compiled_during, tree_allclose


def _params(dtype=jnp.float64):
    model = eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    return jax.tree.map(lambda p: p.astype(dtype), params)


def _grads(params, i):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(i), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)],
    )


def _mu(state) -> Any:
    """Adam's first moment in its state."""
    return cast(optax.ScaleByAdamState, state).mu


def _run(opt, params, steps=4):
    # optax's Adam mixes Python floats with integer counts, which the suite's
    # strict dtype promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
        update = jax.jit(opt.update)
        out = []
        for i in range(steps):
            updates, state = update(_grads(params, i), state, params)
            out.append(updates)
    return out, state


@pytest.mark.parametrize(
    "inner", [optax.scale_by_adam(), optax.adamw(0.1)], ids=["adam", "adamw"]
)
def test_a_small_model_is_flattened_and_takes_the_same_updates(inner):
    params = _params()  # 50 parameters in 4 leaves
    flat, flat_state = _run(optim.flatten_if_small(inner), params)
    leafwise, leaf_state = _run(inner, params)
    for a, b in zip(flat, leafwise):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert tree_allclose(a, b, rtol=1e-13, atol=1e-15)
    moments = [x for x in jax.tree.leaves(flat_state) if x.ndim > 0]
    assert moments and all(x.shape == (50,) for x in moments)
    assert jax.tree.structure(flat_state) != jax.tree.structure(leaf_state)


def test_above_max_size_the_state_is_the_inners_own():
    params = _params()
    small = optim.flatten_if_small(optax.scale_by_adam(), max_size=49)
    state = small.init(params)
    expected = optax.scale_by_adam().init(params)
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    assert tree_allclose(_run(small, params)[0], _run(optax.scale_by_adam(), params)[0])
    # At exactly max_size, flattened.
    exact = optim.flatten_if_small(optax.scale_by_adam(), max_size=50)
    assert _mu(exact.init(params)).shape == (50,)


def test_leaves_of_several_dtypes_are_not_flattened():
    # Flattening would promote the bfloat16 leaf to float32; it keeps its dtype.
    params = {
        "half": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.bfloat16),
        "single": jnp.linspace(1.0, 2.0, 4, dtype=jnp.float32),
    }
    opt = optim.flatten_if_small(optax.scale_by_adam())
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
        updates, _ = opt.update(params, state)
    assert _mu(state)["half"].dtype == jnp.bfloat16
    assert cast(dict, updates)["half"].dtype == jnp.bfloat16


def test_one_leaf_is_left_as_it_is():
    params = jnp.arange(4.0)
    state = optim.flatten_if_small(optax.scale_by_adam()).init(params)
    assert jax.tree.structure(state) == jax.tree.structure(
        optax.scale_by_adam().init(params)
    )


def test_the_state_is_a_fixed_structure_scan_carry():
    params = _params()
    opt = optim.flatten_if_small(optax.scale_by_adam())

    def body(state, i):
        updates, state = opt.update(_grads(params, 0), state, params)
        return state, jax.tree.leaves(updates)[0]

    with jax.numpy_dtype_promotion("standard"):
        state, _ = jax.lax.scan(body, opt.init(params), jnp.arange(3))
    assert jax.tree.structure(state) == jax.tree.structure(opt.init(params))


@pytest.mark.parametrize("max_size", [-1, 1.5, True, "big"])
def test_max_size_is_checked(max_size, unchecked):
    del unchecked
    with pytest.raises(ValueError, match="max_size"):
        optim.flatten_if_small(optax.scale_by_adam(), max_size=max_size)


def test_leaves_without_a_dtype_are_left_to_inner():
    # Python numbers beside arrays: not concatenated (optax.flatten would promote).
    params = {"a": jnp.ones(3), "b": 1.0}
    opt = optim.flatten_if_small(optax.scale_by_adam())
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(
        optax.scale_by_adam().init(params)
    )


@pytest.mark.parametrize("max_size", [2**17, 0], ids=["flat", "leafwise"])
def test_init_is_one_program_run_where_the_parameters_are(max_size):
    """Called eagerly, `init` compiles one program, not one for each leaf shape,
    on the parameters' device, and gives optax's own state: the same values,
    dtypes and weak types."""
    model = eqx.nn.MLP(5, 3, 11, 2, key=jax.random.key(1))
    params = jax.device_put(eqx.filter(model, eqx.is_inexact_array), jax.devices()[-1])
    opt = optim.flatten_if_small(optax.scale_by_adam(), max_size=max_size)
    compiled = compiled_during(lambda: opt.init(params))
    assert len(compiled) == 1, compiled
    state = opt.init(params)
    inner = optax.scale_by_adam()
    expected = (optax.flatten(inner) if max_size else inner).init(params)
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        assert (got.shape, got.dtype, got.weak_type) == (
            want.shape,
            want.dtype,
            want.weak_type,
        )
        assert bool(jnp.all(got == want))
        if got.ndim:  # the moments; optax places its count on the default device
            assert got.devices() == {jax.devices()[-1]}
