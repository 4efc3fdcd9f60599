"""K-FAC as optax transformations.

```python
opt = ef.optim.kfac(1e-2, damping=1e-3)
state = opt.init(params)
loss, grads, curv = ef.value_grad_and_curvature(
    loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC())(model, batch, key=key)
updates, state = opt.update(grads, state, params, curvature=curv)
```

The first `update` fills the curvature slots of the state, so a jitted step traces
twice (steps 1 and 2) and never again.
"""

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from ._adaptive import AdaptiveState, QuadraticModel, adaptive_steps, quadratic_model
from .blocks import KroneckerFactored
from .curvature import Curvature


ScalarOrSchedule = float | Float[Array, ""] | optax.Schedule


class KFACState(NamedTuple):
    """State of `kfac_preconditioner`.

    - `count`: updates seen.
    - `curvature_count`: finite curvature estimates folded into the average.
    - `curvature`: the bias-corrected moving average of the curvature (or None
      before the first update).
    - `inverse`: what preconditions the gradient, refreshed every `inverse_every`
      updates: the average with its factor eigendecompositions (damping mode
      "exact"), or with each K-FAC block replaced by its π-damped inverse, itself a
      Kronecker block ("factored").
    - `nonfinite_count`: curvature estimates rejected for holding NaN or inf.
    """

    count: Int[Array, ""]
    curvature_count: Int[Array, ""]
    curvature: Curvature | None
    inverse: Curvature | None
    nonfinite_count: Int[Array, ""]


def _value(x: ScalarOrSchedule, count: Array) -> Array:
    return x(count) if callable(x) else jnp.asarray(x)


def _check(name: str, value: Any, low: float, high: float | None, closed: bool) -> None:
    if callable(value) or isinstance(value, jax.core.Tracer):
        return
    v = float(value)
    ok = (v >= low if closed else v > low) and (high is None or v < high)
    if not ok:
        bounds = f"[{low}, {high})" if closed else f"> {low}"
        raise ValueError(
            f"`eqfisher.optim.kfac_preconditioner(..., {name}=...)`: `{name}` must be "
            f"{bounds}, got {value!r}."
        )


DampingMode = Literal["exact", "factored"]


def _factored_inverse(block: KroneckerFactored, lam) -> KroneckerFactored:
    """(G + (√λ/π)·I)⁻¹ ⊗ (A + π√λ·I)⁻¹ as a Kronecker block: its `mv` is the
    π-damped solve (`KroneckerFactored.solve_factored`), two products per step."""
    d_a, d_g = block.a.shape[0], block.g.shape[0]
    pi = jnp.sqrt((jnp.trace(block.a) / d_a) / (jnp.trace(block.g) / d_g))
    # A zero factor (a layer that never saw data) gives π = 0 or ∞; fall back to 1.
    pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0).astype(block.a.dtype)
    root = jnp.sqrt(jnp.asarray(lam, block.a.dtype))

    def inv(m, shift):
        chol = jax.scipy.linalg.cho_factor(
            m + shift * jnp.eye(m.shape[0], dtype=m.dtype)
        )
        return jax.scipy.linalg.cho_solve(chol, jnp.eye(m.shape[0], dtype=m.dtype))

    return KroneckerFactored(
        inv(block.a, pi * root),
        inv(block.g, root / pi),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )


def _precompute(curv: Curvature, lam, mode: DampingMode) -> Curvature:
    """What the preconditioner caches between refreshes: factor eigendecompositions
    ("exact"), or the damped factors' inverses ("factored")."""
    blocks = {}
    for k, b in curv.blocks.items():
        if isinstance(b, KroneckerFactored):
            b = b.precompute() if mode == "exact" else _factored_inverse(b, lam)
        blocks[k] = b
    return Curvature(blocks, curv.leaf_indices, curv.structure, curv.leaf_slices)


def _apply_inverse(inverse: Curvature, updates, lam, mode: DampingMode):
    def fn(block, v):
        if mode == "factored" and isinstance(block, KroneckerFactored):
            return block.mv(v)  # the cached inverse
        return block.solve(v, lam)

    return inverse._map(updates, fn, "solve")


def _all_finite(tree: PyTree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _precondition(
    updates, state: KFACState, curvature, lam, decay, inverse_every, mode="exact"
):
    """Folds `curvature` into the average and returns (C + λI)⁻¹ updates."""
    if not isinstance(curvature, Curvature):
        raise ValueError(
            "`kfac_preconditioner.update(grads, state, params, curvature=...)` "
            "needs `curvature=`, an `eqfisher.Curvature` of this batch."
        )
    finite = _all_finite(curvature)
    count = state.count + 1
    if state.curvature is None:
        avg = jax.tree_util.tree_map(
            lambda x: jnp.where(finite, x, jnp.zeros_like(x)), curvature
        )
        inverse = _precompute(avg, lam, mode)
        n_good = finite.astype(jnp.int32)
    else:
        n_good = state.curvature_count + finite.astype(jnp.int32)
        # Time-varying decay = the bias-corrected average of every factor.
        t = n_good.astype(jnp.float32)
        d = decay * (1 - decay ** (t - 1)) / (1 - decay**t)
        d = jnp.where(n_good > 1, d, 0.0)
        mixed = state.curvature.ema(curvature, jnp.clip(d, 0.0, 1.0))
        avg = jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old), mixed, state.curvature
        )
        # Early estimates change fast: refresh at every step until the average
        # has seen `inverse_every` batches, then every `inverse_every` steps.
        refresh = (state.count < inverse_every) | (state.count % inverse_every == 0)
        inverse = jax.lax.cond(
            refresh, lambda: _precompute(avg, lam, mode), lambda: state.inverse
        )
    try:
        direction = _apply_inverse(inverse, updates, lam, mode)
    except ValueError as e:
        raise ValueError(
            "`kfac_preconditioner.update`: the gradients and the curvature cover "
            "different parameters. For a curvature built with `where=`, wrap the "
            "optimiser in `optax.masked(..., eqfisher.filters.optax_mask(model, "
            "where))`."
        ) from e
    # No finite curvature seen yet: no step rather than an unpreconditioned one.
    direction = jax.tree_util.tree_map(
        lambda x: jnp.where(n_good > 0, x, jnp.zeros_like(x)), direction
    )
    new_state = KFACState(
        count,
        n_good,
        avg,
        inverse,
        state.nonfinite_count + (1 - finite.astype(jnp.int32)),
    )
    return direction, new_state


def _constrain(direction, grads, constraint, learning_rate):
    """Scales `direction` Δ so that lr²·Δᵀg ≤ `constraint` (Δᵀg ≈ ΔᵀCΔ: the step's
    squared length in the curvature metric), as kfac_jax's `norm_constraint`."""
    inner = sum(
        jnp.sum(d * g)
        for d, g in zip(
            jax.tree_util.tree_leaves(direction), jax.tree_util.tree_leaves(grads)
        )
    )
    size = learning_rate**2 * jnp.maximum(inner, 0.0)
    scale = jnp.minimum(1.0, jnp.sqrt(constraint / jnp.maximum(size, 1e-30)))
    return jax.tree_util.tree_map(lambda d: (scale * d).astype(d.dtype), direction)


def kfac_preconditioner(
    *,
    damping: ScalarOrSchedule,
    decay: float = 0.95,
    inverse_every: int = 10,
    damping_mode: DampingMode = "factored",
    norm_constraint: float | None = None,
    learning_rate: ScalarOrSchedule = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """Preconditions gradients by a damped, averaged curvature: (C + λI)⁻¹ g.

    **Arguments:**

    - `damping`: λ > 0, a float or an optax schedule of the step count.
    - `decay`: the moving-average weight of old curvature, in [0, 1).
    - `inverse_every`: refresh the cached inverses every this many steps (inside
      jit; no recompilation), and at every one of the first `inverse_every` steps,
      while the average is young.
    - `damping_mode`: how K-FAC blocks are damped. `"factored"` (default, as in
      kfac_jax): Martens & Grosse's π-damped (G + (√λ/π)I)⁻¹ ⊗ (A + π√λ I)⁻¹,
      with the two inverses cached (Cholesky, cheaper than `eigh`; two products
      per layer and step; the damping in force at a refresh is used until the
      next). `"exact"`: (G ⊗ A + λI)⁻¹, through cached factor eigendecompositions
      (four products per layer and step; a damping schedule acts at every step).
      Other blocks are always solved exactly.
    - `norm_constraint`: if given, c > 0: the direction Δ is scaled down so that
      lr²·Δᵀg ≤ c, a trust region on the step's length in the curvature metric
      (Δᵀg ≈ ΔᵀCΔ; kfac_jax's `norm_constraint`, ACKTR's KL clipping). It lets
      large learning rates through early, when the curvature is poorly known.
    - `learning_rate`: the rate the caller applies afterwards (a float or an optax
      schedule), used only by `norm_constraint`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; call
    `update(grads, state, params, curvature=curv)` with `curv` from
    `eqfisher.curvature` or `eqfisher.value_grad_and_curvature`. A curvature holding
    NaN or inf is not averaged in: the last good estimate is kept and
    `state.nonfinite_count` counts the event.
    """
    _check("damping", damping, 0.0, None, False)
    _check("decay", decay, 0.0, 1.0, True)
    if not isinstance(inverse_every, int) or inverse_every < 1:
        raise ValueError(
            "`eqfisher.optim.kfac_preconditioner(..., inverse_every=...)`: must be a "
            f"positive int, got {inverse_every!r}."
        )
    if norm_constraint is not None:
        _check("norm_constraint", norm_constraint, 0.0, None, False)
    if damping_mode not in ("exact", "factored"):
        raise ValueError(
            "`eqfisher.optim.kfac_preconditioner(..., damping_mode=...)`: must be "
            f'"exact" or "factored", got {damping_mode!r}.'
        )

    def init(params):
        del params
        zero = jnp.zeros((), jnp.int32)
        return KFACState(zero, zero, None, None, zero)

    def update(updates, state, params=None, *, curvature=None, **extra):
        del params, extra
        lam = _value(damping, state.count)
        direction, new_state = _precondition(
            updates, state, curvature, lam, decay, inverse_every, damping_mode
        )
        if norm_constraint is not None:
            lr = _value(learning_rate, state.count)
            direction = _constrain(direction, updates, norm_constraint, lr)
        return direction, new_state

    return optax.GradientTransformationExtraArgs(init, update)


def kfac(
    learning_rate: ScalarOrSchedule,
    *,
    damping: ScalarOrSchedule = 1e-3,
    momentum: float = 0.9,
    decay: float = 0.95,
    inverse_every: int = 10,
    weight_decay: float = 0.0,
    damping_mode: DampingMode = "factored",
    norm_constraint: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC, ready to use: preconditioner, weight decay, momentum, learning rate.

    **Arguments:**

    - `learning_rate`: a float or an optax schedule.
    - `damping`, `decay`, `inverse_every`, `damping_mode`, `norm_constraint`: see
      `kfac_preconditioner`.
    - `momentum`: heavy-ball momentum on the preconditioned direction (0 for none).
    - `weight_decay`: added to the preconditioned direction, decoupled as in AdamW.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` (it composes with `optax.chain`,
    `optax.clip_by_global_norm`, `optax.masked`); call
    `opt.update(grads, state, params, curvature=curv)`.
    """
    parts = [
        kfac_preconditioner(
            damping=damping,
            decay=decay,
            inverse_every=inverse_every,
            damping_mode=damping_mode,
            norm_constraint=norm_constraint,
            learning_rate=learning_rate,
        )
    ]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    if momentum:
        parts.append(optax.trace(decay=momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


class AdaptiveKFACState(NamedTuple):
    """State of `kfac_adaptive`: the preconditioner's and the step rule's."""

    kfac: KFACState
    steps: AdaptiveState


def kfac_adaptive(
    *,
    initial_damping: float = 1.0,
    decay: float = 0.95,
    inverse_every: int = 10,
    adapt_every: int = 5,
    weight_decay: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC with the learning rate, momentum and damping chosen automatically.

    Each step minimises the exact Gauss-Newton quadratic model over αΔ + μδ₋₁
    (Δ the preconditioned direction, δ₋₁ the last update), and every `adapt_every`
    steps adapts the damping by the Levenberg–Marquardt rule on the ratio of the
    actual to the predicted loss reduction (Martens & Grosse 2015). Meant for large
    batches: the model is that of one batch.

    Call `update(grads, state, params, curvature=curv,
    quadratic=eqfisher.optim.quadratic_model(loss_fn, model, batch))`; the result
    is the full update (no learning rate to apply).
    """
    _check("initial_damping", initial_damping, 0.0, None, False)
    _check("decay", decay, 0.0, 1.0, True)
    steps = adaptive_steps(initial_damping=initial_damping, adapt_every=adapt_every)

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return AdaptiveKFACState(
            KFACState(zero, zero, None, None, zero), steps.init(params)
        )

    def update(updates, state, params=None, *, curvature=None, quadratic=None, **extra):
        del extra
        if weight_decay:
            updates = jax.tree_util.tree_map(
                lambda g, p: g + weight_decay * p, updates, params
            )
        lam = state.steps.damping
        direction, kstate = _precondition(
            updates, state.kfac, curvature, lam, decay, inverse_every
        )
        delta = jax.tree_util.tree_map(jnp.negative, direction)
        step, sstate = steps.update(
            delta, state.steps, params, quadratic=quadratic, grads=updates
        )
        return step, AdaptiveKFACState(kstate, sstate)

    return optax.GradientTransformationExtraArgs(init, update)


def curvature_ok(state: Any) -> Array:
    """True when no curvature estimate has been rejected as non-finite."""
    for s in jax.tree_util.tree_leaves(
        state, is_leaf=lambda x: isinstance(x, KFACState)
    ):
        if isinstance(s, KFACState):
            return s.nonfinite_count == 0
    raise ValueError("`curvature_ok(state)`: no K-FAC state found in `state`.")


__all__ = [
    "AdaptiveKFACState",
    "KFACState",
    "QuadraticModel",
    "curvature_ok",
    "kfac",
    "kfac_adaptive",
    "kfac_preconditioner",
    "quadratic_model",
]
