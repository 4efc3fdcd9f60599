"""The one-call K-FAC training step, with amortised statistics."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PyTree

from .. import _compat
from .._curvature import AbstractEstimator, AbstractStructure, value_grad_and_curvature
from ._state import check_positive_int, find_kfac_state


def _leading(batch: PyTree, size: int | None) -> PyTree:
    """The first `size` examples of every leaf of `batch` (all when `None`)."""
    if size is None:
        return batch
    return jax.tree_util.tree_map(lambda x: x[:size], batch)


def _due(period: int, opt_state: PyTree) -> Array | None:
    """Whether statistics are due at this step (every `period`-th, by the K-FAC
    state's count; a traced bool), or None when they always are."""
    if period == 1:
        return None
    return find_kfac_state(opt_state).count % period == 0


def _placeholder(vgc, model, batch, key) -> PyTree:
    """Zeros in the shape of `vgc`'s curvature: what a step between estimates
    passes as `curvature=` (with `curvature_due` False), so that the optimiser's
    update is traced and compiled once, outside the choice of step."""
    like = eqx.filter_eval_shape(vgc, model, batch, key=key)[2]
    return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), like)


def _shares_forward(loss_fn, model, batch, period, curvature_batch_size) -> bool:
    """Whether a statistics step takes its loss and gradient from the statistics
    pass (one forward), with the gradient inside the `lax.cond` on the period.

    Not when the statistics come from a sub-batch, and not for a model with
    convolutions on CPU: XLA:CPU runs convolutions inside control flow 10-100x
    slower than outside (jax-ml/jax#12868), so there the gradient is computed
    outside the `cond` and a statistics step pays one more forward and backward.
    """
    if curvature_batch_size is not None:
        return False
    if period == 1 or jax.default_backend() != "cpu":
        return True
    arrays, static = eqx.partition((model, batch), eqx.is_array)
    names = _compat.primitive_names(lambda a: loss_fn(*eqx.combine(a, static)), arrays)
    return "conv_general_dilated" not in names


def kfac_step(
    loss_fn: Callable,
    optimiser: optax.GradientTransformationExtraArgs,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    curvature_update_period: int = 4,
    curvature_batch_size: int | None = None,
) -> Callable:
    r"""One jitted training step: gradient, curvature when due, optimiser update.

    Every `curvature_update_period`-th step (counted by the K-FAC state, chosen with
    `lax.cond` inside jit: one compilation) computes the loss, the gradient and the
    curvature with `eqfisher.value_grad_and_curvature` (one forward); the steps in
    between cost one value-and-gradient plus the cached preconditioner's products.
    On CPU, for a model with convolutions, the gradient is computed outside the
    `cond` on every step and a statistics step adds the statistics pass, because
    XLA:CPU runs convolutions inside control flow far slower (jax-ml/jax#12868).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, returning a scalar.
    - `optimiser`: a transformation containing one K-FAC preconditioner (`kfac`,
      `kfac_preconditioner` inside an `optax.chain`, ...), built with a `like=`
      from the same `loss_fn`, `estimator` and `structure`.
    - `estimator`, `structure`: as for `eqfisher.value_grad_and_curvature`.
    - `curvature_update_period`: $k \ge 1$: curvature statistics at steps
      $0, k, 2k, \ldots$ (default 4, from the benchmark grid: about the steps to a
      target of $k = 1$ on four of its five problems, at half the seconds per step).
      On CPU, a convolutional model may prefer 1: XLA:CPU runs convolutions inside
      `lax.cond` far slower (jax-ml/jax#12868).
    - `curvature_batch_size`: `None` (the whole batch), or n: the statistics come
      from the first n examples of every leaf of `batch` (leading axis), the
      gradient from the whole batch (one extra forward and backward on n
      examples).

    **Returns:**

    `step(model, opt_state, batch, key=None) -> (model, opt_state, loss)`, jitted;
    `key` is needed by Monte-Carlo estimators.

    **Raises:**

    `ValueError` when `curvature_update_period` or `curvature_batch_size` is not a
    positive integer; at the first step, when `optimiser`'s state holds no K-FAC
    state, and the errors of `eqfisher.value_grad_and_curvature`.

    !!! Example

        ```python
        estimator, structure = ef.FisherMC(), ef.KFAC()
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=estimator, structure=structure
        )
        opt = ef.optim.kfac(0.1, like=ef.optim.curvature_like(vgc, model, batch, key=key))
        step = ef.optim.kfac_step(loss_fn, opt, estimator=estimator, structure=structure)
        state = opt.init(params)
        for i in range(3):
            model, state, loss = step(model, state, batch, jax.random.key(i))
        ```
    """
    caller = "kfac_step"
    check_positive_int(caller, "curvature_update_period", curvature_update_period)
    if curvature_batch_size is not None:
        check_positive_int(caller, "curvature_batch_size", curvature_batch_size)
    vgc = value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    value_and_grad = eqx.filter_value_and_grad(loss_fn)

    @eqx.filter_jit
    def step(model, opt_state, batch, key=None):
        period = curvature_update_period
        if _shares_forward(loss_fn, model, batch, period, curvature_batch_size):
            update = _shared_forward_update
        else:
            update = functools.partial(
                _separate_update, batch_size=curvature_batch_size
            )
        loss, updates, opt_state = update(
            vgc, value_and_grad, optimiser, period, model, opt_state, batch, key
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def _shared_forward_update(
    vgc, value_and_grad, optimiser, period, model, opt_state, batch, key
):
    """`(loss, updates, state)`: a statistics step takes its loss and gradient from
    the statistics pass (one forward); the other steps from `value_and_grad`. Only
    these passes are chosen by `lax.cond`: the optimiser's update is outside it."""
    params = eqx.filter(model, eqx.is_inexact_array)
    due = _due(period, opt_state)
    if due is None:
        loss, grads, curv = vgc(model, batch, key=key)
    else:

        def plain():
            return *value_and_grad(model, batch), _placeholder(vgc, model, batch, key)

        loss, grads, curv = jax.lax.cond(due, lambda: vgc(model, batch, key=key), plain)
    updates, opt_state = optimiser.update(
        grads, opt_state, params, curvature=curv, curvature_due=due
    )
    return loss, updates, opt_state


def _separate_update(
    vgc, value_and_grad, optimiser, period, model, opt_state, batch, key, *, batch_size
):
    """`(loss, updates, state)` with the gradient computed outside the choice of
    step (for convolutions on CPU, or statistics from a sub-batch): the statistics
    steps add the statistics pass on the first `batch_size` examples."""
    params = eqx.filter(model, eqx.is_inexact_array)
    loss, grads = value_and_grad(model, batch)
    sub = _leading(batch, batch_size)
    due = _due(period, opt_state)
    if due is None:
        curv = vgc(model, sub, key=key)[2]
    else:
        curv = jax.lax.cond(
            due,
            lambda: vgc(model, sub, key=key)[2],
            lambda: _placeholder(vgc, model, sub, key),
        )
    updates, opt_state = optimiser.update(
        grads, opt_state, params, curvature=curv, curvature_due=due
    )
    return loss, updates, opt_state
