from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from . import _compat


def _stop_hessian_call(static: PyTree, dynamic: PyTree) -> PyTree:
    fn, args, kwargs = eqx.combine(dynamic, static)
    return fn(*args, **kwargs)


# `static` holds everything that is not an array (functions, Python scalars, the
# structure of `fn` itself) and is passed through untouched; `dynamic` holds every
# array, including those `fn` holds (a Module's parameters) or closes over.
_call = jax.custom_jvp(_stop_hessian_call, nondiff_argnums=(0,))


@_call.defjvp
def _call_jvp(
    static: PyTree, primals: tuple[PyTree], tangents: tuple[PyTree]
) -> tuple[PyTree, PyTree]:
    (dynamic,) = primals
    (t_dynamic,) = tangents
    # The primal goes through `_call` again, so that any outer derivative of it is
    # taken by this same rule: every derivative of order two or more through `fn`
    # is dropped, not only the second.
    out = _call(static, dynamic)
    # J(x)·ẋ with the Jacobian evaluated at stop_gradient(x): linear in ẋ, constant
    # in x. The stop_gradient acts on primals, never on tangents, so transposing this
    # (reverse mode) only transposes ordinary JVP operations.
    dynamic_stopped = jax.lax.stop_gradient(dynamic)
    _, t_out = jax.jvp(
        lambda d: _stop_hessian_call(static, d), (dynamic_stopped,), (t_dynamic,)
    )
    return out, t_out


def _strong(x: Any) -> Any:
    if eqx.is_array(x) and getattr(x, "weak_type", False):
        return jax.lax.convert_element_type(x, x.dtype)
    return x


# Marks each output of `stop_hessian`, so that eqfisher's tracer knows that the
# value adds no curvature (see `eqfisher._tracer.analyses.objective`).
hessian_stopped_p = _compat.define_marker_primitive("eqfisher_hessian_stopped")


def _mark(x: Any) -> Any:
    if eqx.is_inexact_array(x):
        return hessian_stopped_p.bind(x)
    return x


class _StopHessian(eqx.Module):
    fn: Callable[..., PyTree]

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        # Weakly typed inputs (Python scalars under `jax.grad`) lose their weak type
        # on the way through `custom_jvp`, which the closure-converted `fn` would
        # then refuse: make them strongly typed first.
        args, kwargs = jax.tree_util.tree_map(_strong, (args, kwargs))
        # Arrays `fn` closes over, tracers of enclosing transformations included,
        # become leaves of `fn` and so inputs like any other.
        fn = eqx.filter_closure_convert(self.fn, *args, **kwargs)
        dynamic, static = eqx.partition((fn, args, kwargs), eqx.is_array)
        return jax.tree_util.tree_map(_mark, _call(static, dynamic))


def stop_hessian(fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
    """Wrap `fn` so that its values and first derivatives are kept and all its
    higher derivatives are dropped, in forward and reverse mode alike.

    For `h(x) = g(stop_hessian(f)(x))`, `jax.hessian(h)` is the Gauss-Newton matrix
    `J_fᵀ H_g J_f` rather than the full Hessian, which would add the term
    `Σᵢ ∂g/∂fᵢ ∇²fᵢ`. This holds for all four of `jacfwd∘jacfwd`, `jacfwd∘jacrev`,
    `jacrev∘jacfwd` and `jacrev∘jacrev`.

    *Why this works in reverse mode.* The wrapped call is a `jax.custom_jvp` whose
    rule returns the tangent `J(stop_gradient(x))·ẋ`, computed by `jax.jvp` of `fn`
    at the stopped point. That tangent is linear in `ẋ`, so reverse mode transposes
    it (as `J(x)ᵀ·ȳ`), and it is constant in `x`, so differentiating it again gives
    zero. `stop_gradient` acts only on primal values, never on a tangent, so no
    transpose rule for `stop_gradient` is needed. (Stopping the *tangent* instead
    works in forward mode but cannot be transposed.) Under `jax.jit`, XLA merges the
    forward at `stop_gradient(x)` with the one at `x`: `stop_gradient` lowers to the
    identity.

    **Arguments:**

    - `fn`: a callable taking and returning PyTrees; its outputs must be arrays. The
        arrays it holds (the parameters of an `eqx.Module`) or closes over are
        inputs too: their higher derivatives are dropped as well.

    **Returns:**

    A callable with the signature of `fn`. It is an `eqx.Module` holding `fn`, so
    `stop_hessian(model)` has the parameters of `model` as its leaves.

    **Raises:**

    `TypeError` when `fn` is not callable.

    !!! Example

        ```python
        f = lambda x: jnp.sin(jnp.cos(x))
        h = lambda x: 0.5 * ef.stop_hessian(f)(x) ** 2
        jax.hessian(h)(1.0)  # f'(1)², without the f(1) f''(1) term
        ```
    """
    if not callable(fn):
        raise TypeError(
            f"`eqfisher.stop_hessian(fn)`: `fn` must be callable, got {type(fn)}."
        )
    return _StopHessian(fn)
