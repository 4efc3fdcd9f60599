"""Exact, matrix-free curvature products as lineax operators, and `stop_hessian`."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import optax
from jaxtyping import Array, Float, PyTree

from ._stop_hessian import stop_hessian as stop_hessian
from ._tracer import StagedLoss, calls_custom_vjp, split


def _structure(model: PyTree) -> PyTree:
    params = eqx.filter(model, eqx.is_inexact_array)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )


def _tag_fn(loss_fn: Callable, model: PyTree, batch: PyTree, caller: str):
    """`(params_tree -> tag inputs)`, the registered losses, and rebuild helpers."""
    s = split(model, batch)
    processed = StagedLoss(loss_fn, caller).stage(s, layers=False)
    coefs = processed.coefficients(s.inputs)

    def fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        ev = processed.run(leaves + s.others + s.batch)
        return tuple(t[0] for t in ev.tags), processed.losses(ev, coefs)

    return fn, eqx.filter(model, eqx.is_inexact_array), processed.calls_custom_vjp


def _output_product(
    loss_fn, model, batch, caller, weigh: Callable
) -> lx.FunctionLinearOperator:
    fn, params, custom_vjp = _tag_fn(loss_fn, model, batch, caller)
    if custom_vjp:
        # A `jax.custom_vjp` has no forward-mode rule: J v is the transpose of
        # the (linear) VJP, as `jax.jacrev` works where `jax.jacfwd` cannot.
        outs, vjp_fn, losses = jax.vjp(fn, params, has_aux=True)
        transposed = jax.linear_transpose(vjp_fn, outs)

        def jvp_fn(v):
            return transposed((v,))[0]
    else:
        _, jvp_fn, losses = jax.linearize(fn, params, has_aux=True)
        vjp_fn = jax.linear_transpose(jvp_fn, params)

    def mv(v):
        jv = jvp_fn(v)
        return vjp_fn(tuple(weigh(loss, t) for loss, t in zip(losses, jv)))[0]

    return lx.FunctionLinearOperator(
        mv, _structure(model), tags=(lx.symmetric_tag, lx.positive_semidefinite_tag)
    )


def ggn_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> lx.FunctionLinearOperator:
    r"""The exact GGN $\sum_n w_n J_n^\top H_n J_n$ as a matrix-free lineax operator.

    One Jacobian-vector product, the loss Hessians, and one vector-Jacobian product
    per `mv`; symmetric and positive-semidefinite, so `lineax.CG` works on it (add
    damping first). The operand is a PyTree like `eqx.filter(model,
    eqx.is_inexact_array)`.

    **Raises:**

    `ValueError` when `loss_fn` registers no loss, or its value is not affine in
    the registered losses (the message names the fix).

    !!! Example

        ```python
        ggn = ef.ggn_operator(loss_fn, model, batch)
        damped = lx.TaggedLinearOperator(
            ggn + lx.IdentityLinearOperator(ggn.in_structure()) * 1e-3,
            lx.positive_semidefinite_tag,
        )
        solution = lx.linear_solve(damped, grads, lx.CG(rtol=1e-6, atol=1e-6))
        step = solution.value  # (G + 0.001 I)⁻¹ g, like grads
        ```
    """

    def weigh(loss, t):
        w = loss.weights()[..., None]
        return w * loss.family.hessian_mv(loss.inputs, t)

    return _output_product(loss_fn, model, batch, "eqfisher.ggn_operator", weigh)


def empirical_fisher_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> lx.FunctionLinearOperator:
    r"""The exact empirical Fisher, matrix-free.

    $\sum_n w_n \nabla \ell_n \nabla \ell_n^\top$, the outer products of the
    per-example loss gradients at the batch's targets; a symmetric,
    positive-semidefinite lineax operator on PyTrees like `eqx.filter(model,
    eqx.is_inexact_array)`.

    As for `eqfisher.EmpiricalFisher`, $\ell_n$ is example $n$'s loss: its entries
    along the other axes of a registered loss (a sequence's $T$ positions) are
    summed before the outer product, and several registered losses add their
    matrices. The example axis is each registered loss's first, whatever the
    batch's is: for outputs laid out otherwise (time-major, or stacked over an
    ensemble's members), this is another matrix than `eqfisher.curvature(...,
    estimator=eqfisher.EmpiricalFisher())`, which finds the example axis (or takes
    `examples=`); use that.

    **Raises:**

    `ValueError` when `loss_fn` registers no loss, or its value is not affine in
    the registered losses (the message names the fix).

    !!! Example

        ```python
        fisher = ef.empirical_fisher_operator(loss_fn, model, batch)
        print(optax.tree_utils.tree_vdot(grads, fisher.mv(grads)))  # gᵀ F g ≥ 0
        ```
    """

    def weigh(loss, t):
        # Example n's gradient pulls back its entries' √w-weighted output
        # gradients, uₙ = Σₜ √wₙₜ Jₙₜᵀ rₙₜ; Σₙ uₙ (uₙᵀ v) pulls back
        # √wₙₜ rₙₜ (uₙᵀ v), with uₙᵀ v = Σₜ √wₙₜ rₙₜ · (J v)ₙₜ.
        r = loss.family.output_gradient(loss.inputs, loss.targets)
        r = r * jnp.sqrt(loss.weights())[..., None]
        along = jnp.sum((r * t).reshape(r.shape[0], -1), axis=1)
        return r * along.reshape((-1,) + (1,) * (r.ndim - 1))

    return _output_product(
        loss_fn, model, batch, "eqfisher.empirical_fisher_operator", weigh
    )


def hessian_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> lx.FunctionLinearOperator:
    """The exact Hessian of `loss_fn` in the parameters, matrix-free (symmetric, not
    necessarily positive-semidefinite), by forward-over-reverse differentiation.

    `loss_fn` needs no registered loss here: it is differentiated as it is. The
    product is forward-over-reverse, or reverse-over-reverse for a `loss_fn`
    that calls a `jax.custom_vjp` function (which has no forward-mode rule).

    **Raises:**

    Nothing of its own: the errors of `loss_fn` and `jax.grad` on it.

    !!! Example

        ```python
        hessian = ef.hessian_operator(loss_fn, model, batch)
        low, high = ef.spectral.extreme_eigenvalues(hessian, iterations=30, key=key)
        ```
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def grad(p):
        return jax.grad(lambda q: loss_fn(eqx.combine(q, static), batch))(p)

    if calls_custom_vjp(lambda p: loss_fn(eqx.combine(p, static), batch), params):
        # A `jax.custom_vjp` function has no forward-mode rule: reverse over
        # reverse instead (its custom rule differentiated), as `jax.jacrev` of
        # `jax.jacrev` works where `jax.hessian` cannot.
        def hvp(v):
            return jax.grad(lambda p: optax.tree_utils.tree_vdot(grad(p), v))(params)

    else:
        _, hvp = jax.linearize(grad, params)
    return lx.FunctionLinearOperator(hvp, _structure(model), tags=(lx.symmetric_tag,))
