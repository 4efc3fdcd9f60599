"""K-FAC with step sizes and damping chosen from the local quadratic model."""

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from jaxtyping import ScalarLike

from .._curvature import Curvature
from ._damping import Tikhonov
from ._kfac import fold, guard, initial_state, precondition, receive
from ._quadratic_model import AdaptiveState, adaptive_steps
from ._state import (
    KFACState,
    check_positive_int,
    check_preconditioner_args,
    check_range,
    is_constant_zero,
    placed,
)


class AdaptiveKFACState(NamedTuple):
    r"""State of `kfac_adaptive`: the preconditioner's and the step rule's.

    - `kfac`: the `KFACState` (averaged curvature, cached inverse, counters).
    - `steps`: the step rule's: `damping` (the current $\lambda$), `previous` (the
      last update), `count`, and `rho` (the reduction ratio of the last
      adaptation: 1 before the first; a step of zero length, which tests
      nothing, keeps it and the damping).

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        state = ef.optim.kfac_adaptive(like=curv, initial_damping=1.0).init(params)
        assert isinstance(state, ef.optim.AdaptiveKFACState)
        assert state.kfac.count == 0 and state.steps.damping == 1.0
        ```
    """

    kfac: KFACState
    steps: AdaptiveState


def kfac_adaptive(
    *,
    like: Curvature,
    initial_damping: float | int = 1.0,
    decay: float | int = 0.95,
    inverse_every: int = 1,
    adapt_every: int = 5,
    weight_decay: ScalarLike = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""K-FAC with the learning rate, momentum and damping chosen automatically.

    The objective is the loss plus $\frac{\eta}{2}\lVert\theta\rVert^2$ ($\eta$ =
    `weight_decay`), whose curvature is $G + \eta I$ ($G$ the batch's exact
    Gauss-Newton matrix). Each step minimises the damped quadratic model,
    curvature $G + (\eta + \lambda) I$, over $\alpha \Delta + \mu \delta_{-1}$
    ($\Delta = -(\bar C + (\eta + \lambda) I)^{-1} g$ the preconditioned direction,
    $\delta_{-1}$ the last update; over $\alpha$ alone when $\delta_{-1}$ is zero or
    parallel to $\Delta$, and no step when $\Delta$ is zero or a term is not
    finite), and every `adapt_every` steps adapts the damping $\lambda$ by the
    Levenberg–Marquardt rule on $\rho$, the objective's change over that of the
    undamped model $G + \eta I$ (Martens & Grosse 2015, §6.5–7; kfac_jax's
    default). Meant for large batches: the model is that of one batch.

    **Arguments:**

    - `like`: see `kfac_preconditioner`.
    - `initial_damping`: the first $\lambda > 0$.
    - `decay`: see `kfac_preconditioner`.
    - `inverse_every`: as in `kfac_preconditioner`; $\lambda$ changes take effect at
      the next refresh (with the default 1, at once).
    - `adapt_every`: steps between Levenberg–Marquardt adaptations, a positive int.
    - `weight_decay`: $\eta \ge 0$, the objective's ℓ2 coefficient: $\eta\theta$ is
      added to the gradient and $\eta I$ to the curvature.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; call `update(grads, state, params,
    curvature=curv, quadratic=eqfisher.optim.quadratic_model(loss_fn, model,
    batch))`. The result is the full update (no learning rate to apply). An
    update without `curvature=` before any curvature has been received raises (a
    `ValueError`; under `jit`, Equinox's runtime error).

    !!! Example

        ```python
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac_adaptive(like=ef.optim.curvature_like(vgc, model, batch))

        @eqx.filter_jit
        def step(model, state):
            params = eqx.filter(model, eqx.is_inexact_array)
            loss, grads, curv = vgc(model, batch)
            quadratic = ef.optim.quadratic_model(loss_fn, model, batch)
            updates, state = opt.update(
                grads, state, params, curvature=curv, quadratic=quadratic
            )
            return eqx.apply_updates(model, updates), state

        trained, state = model, opt.init(params)
        for _ in range(10):
            trained, state = step(trained, state)
        assert loss_fn(trained, batch) < loss_fn(model, batch)
        print(state.steps.damping)  # adapted every 5 steps from 1.0
        ```
    """
    caller = "kfac_adaptive"
    check_preconditioner_args(
        caller, like, "initial_damping", initial_damping, decay, inverse_every
    )
    check_positive_int(caller, "adapt_every", adapt_every)
    check_range(caller, "weight_decay", weight_decay, 0.0, None, True)
    steps = adaptive_steps(
        initial_damping=initial_damping,
        adapt_every=adapt_every,
        weight_decay=weight_decay,
    )
    exact = Tikhonov()

    def init(params):
        # The objective's ℓ2 term is part of its curvature: (C̄ + (λ + wd)I)⁻¹.
        lam = jnp.asarray(initial_damping) + weight_decay
        sstate = cast(AdaptiveState, steps.init(params))  # what adaptive_steps keeps
        return AdaptiveKFACState(initial_state(like, lam, exact), sstate)

    def update(
        updates,
        state,
        params=None,
        *,
        curvature=None,
        curvature_due=None,
        quadratic=None,
        **extra,
    ):
        del extra
        if not is_constant_zero(weight_decay):
            updates = jax.tree_util.tree_map(
                lambda g, p: g + weight_decay * p, updates, params
            )

        def fold_in(kstate, curvature):
            lam = state.steps.damping + weight_decay
            return fold(caller, kstate, curvature, lam, decay, inverse_every, exact)

        updates, kstate = receive(
            caller, updates, state.kfac, curvature, curvature_due, fold_in
        )
        direction, kstate = guard(precondition(caller, updates, kstate), kstate)
        delta = jax.tree_util.tree_map(jnp.negative, direction)
        step, sstate = steps.update(
            delta, state.steps, params, quadratic=quadratic, grads=updates
        )
        return step, AdaptiveKFACState(kstate, cast(AdaptiveState, sstate))

    # optax types a state as an array tree; this one holds Curvatures (pytrees too).
    return placed(optax.GradientTransformationExtraArgs(init, update))  # pyright: ignore[reportArgumentType]
