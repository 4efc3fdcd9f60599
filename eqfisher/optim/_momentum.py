"""Momentum and the final updates of `kfac`, in each parameter's own dtype.

`optax.inject_hyperparams` holds `momentum`, `weight_decay` and `learning_rate` as
float32 arrays, not Python floats: optax's `trace`, `add_decayed_weights` and
`scale_by_learning_rate` then made a bfloat16 leaf's updates (and its momentum)
float32, so a mixed-precision model's state changed dtype after one step.
"""

import jax
import jax.numpy as jnp
import optax
from jaxtyping import ScalarLike


def momentum(decay: ScalarLike) -> optax.GradientTransformation:
    """`optax.trace(decay)` (heavy-ball momentum, the same state), each leaf's
    trace kept in its own dtype."""

    def init(params):
        return optax.TraceState(trace=optax.tree_utils.tree_zeros_like(params))

    def update(updates, state, params=None):
        del params

        def step(g, t):
            if g is None:
                return None
            return (g + jnp.asarray(decay, t.dtype) * t).astype(t.dtype)

        trace = jax.tree.map(step, updates, state.trace, is_leaf=lambda g: g is None)
        return trace, optax.TraceState(trace=trace)

    return optax.GradientTransformation(init, update)


def in_gradient_dtypes(
    inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """`inner`, its updates cast to the dtypes of the gradients it is given (the
    state is `inner`'s)."""

    def update(updates, state, params=None, **extra):
        out, state = inner.update(updates, state, params, **extra)
        cast = jax.tree.map(
            lambda o, g: None if o is None else o.astype(g.dtype),
            out,
            updates,
            is_leaf=lambda o: o is None,
        )
        return cast, state

    return optax.GradientTransformationExtraArgs(inner.init, update)
