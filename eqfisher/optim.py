"""K-FAC as optax transformations, and a one-call training step.

```python
vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC())
like = ef.optim.curvature_like(vgc, model, batch, key=key)  # shapes only
opt = ef.optim.kfac(1e-2, like=like)
state = opt.init(eqx.filter(model, eqx.is_inexact_array))
loss, grads, curv = vgc(model, batch, key=key)
updates, state = opt.update(grads, state, params, curvature=curv)
```

The state holds the averaged curvature and the cached damped inverse from `init`
on, so it has one PyTree structure throughout: a jitted step compiles once and can
be the body of a `lax.scan`, and a fresh `init` is a template for
`eqx.tree_deserialise_leaves`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from . import _compat
from ._adaptive import AdaptiveState, QuadraticModel, adaptive_steps, quadratic_model
from ._curvature import Curvature, value_grad_and_curvature
from ._damping import AbstractDamping, FactoredTikhonov, Tikhonov, tikhonov_inverse
from ._estimators import AbstractEstimator
from ._structures import AbstractStructure


ScalarOrSchedule = float | Float[Array, ""] | optax.Schedule
"""A constant (a float or a scalar array) or an optax schedule: a function from the
step count (an integer array, counting updates from 0) to a scalar, such as
`optax.exponential_decay(1e-1, 100, 0.5)` or
`optax.warmup_cosine_decay_schedule(0.0, 0.3, 10, 1000)`. The learning rate is
evaluated at every update; the damping when the cached inverse is refreshed."""

# Defaults chosen from the grid of benchmarks/kfac_grid.py (benchmarks/RESULTS.md,
# "The defaults grid"): no configuration of it gives a non-finite run at any learning
# rate in 1e-3…1 on its five problems; damping 1e-3 with norm constraint 1e-2 and no
# momentum needs the fewest steps, and statistics every 4th step the fewest seconds
# (steps × measured seconds per step).
DAMPING = 1e-3
MOMENTUM = 0.0
NORM_CONSTRAINT = 1e-2
INVERSE_EVERY = 5
CURVATURE_UPDATE_PERIOD = 4
PI_DAMPING = FactoredTikhonov()


class KFACState(NamedTuple):
    """State of `kfac_preconditioner`; the same PyTree structure at every step.

    - `count`: updates seen.
    - `curvature_count`: finite curvature estimates folded into the average.
    - `nonfinite_count`: curvature estimates rejected for holding NaN or inf.
    - `skipped_count`: updates replaced by zero for being non-finite.
    - `refresh_count`: times the cached inverse was recomputed.
    - `curvature`: the bias-corrected moving average of the curvature (zeros
      before the first estimate).
    - `inverse`: a `Curvature` whose blocks are the damped inverses of the
      average's (see `Tikhonov`, `FactoredTikhonov`): its `mv` preconditions.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac(0.1, like=curv)
        state = opt.init(params)
        updates, state = opt.update(grads, state, params, curvature=curv)
        kstate = ef.optim.find_kfac_state(state)  # inside kfac's optax.chain
        assert kstate.count == 1 and kstate.curvature_count == 1
        assert kstate.refresh_count == 1  # the inverse is refreshed at once
        # The bias-corrected average of one estimate is that estimate.
        assert jnp.allclose(kstate.curvature.as_matrix(), curv.as_matrix())
        ```
    """

    count: Int[Array, ""]
    curvature_count: Int[Array, ""]
    nonfinite_count: Int[Array, ""]
    skipped_count: Int[Array, ""]
    refresh_count: Int[Array, ""]
    curvature: Curvature
    inverse: Curvature


def _value(x: ScalarOrSchedule, count: Array) -> Array:
    return x(count) if callable(x) else jnp.asarray(x)


def _check(
    caller: str, name: str, value: Any, low: float, high: float | None, closed: bool
) -> None:
    if callable(value) or isinstance(value, jax.core.Tracer):
        return
    v = float(value)
    ok = (v >= low if closed else v > low) and (high is None or v < high)
    if not ok:
        bounds = f"[{low}, {high})" if closed else f"> {low}"
        raise ValueError(
            f"`eqfisher.optim.{caller}(..., {name}=...)`: `{name}` must be "
            f"{bounds}, got {value!r}."
        )


def _check_positive_int(caller: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"`eqfisher.optim.{caller}(..., {name}=...)`: must be a positive int, "
            f"got {value!r}."
        )


def _check_like(caller: str, like: Any) -> None:
    if not isinstance(like, Curvature):
        raise TypeError(
            f"`eqfisher.optim.{caller}(..., like=...)` needs a `Curvature` of the "
            "shape the updates will see, e.g. `eqfisher.optim.curvature_like(vgc, "
            f"model, batch, key=key)`; got {type(like).__name__}."
        )


def _all_finite(tree: PyTree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _where(cond: Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(cond, a, b), new, old)


def curvature_like(fn: Callable, *args: Any, **kwargs: Any) -> Curvature:
    """The shape of the curvature `fn(*args, **kwargs)` returns, without computing it.

    **Arguments:**

    - `fn`: a function returning a `Curvature`, or a tuple whose last element is one
      (e.g. the function from `eqfisher.value_grad_and_curvature`).
    - `*args`, `**kwargs`: its arguments (e.g. `model, batch, key=key`).

    **Returns:**

    A `Curvature` whose array leaves are `jax.ShapeDtypeStruct`s: the `like=` of
    `kfac`, `kfac_preconditioner`, `kfac_adaptive`.

    **Raises:**

    `TypeError` when `fn` returns neither a `Curvature` nor a tuple ending in one;
    the errors of `fn` itself (shapes are traced, nothing is computed).

    !!! Example

        ```python
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )
        like = ef.optim.curvature_like(vgc, model, batch, key=key)
        print(like.blocks["layers[0]"].a)  # ShapeDtypeStruct(shape=(5, 5), ...)
        ```
    """
    out = eqx.filter_eval_shape(fn, *args, **kwargs)
    curv = out[-1] if isinstance(out, tuple) else out
    if not isinstance(curv, Curvature):
        raise TypeError(
            "`eqfisher.optim.curvature_like(fn, ...)`: `fn` must return a "
            "`Curvature` or a tuple ending in one (value_grad_and_curvature's "
            f"function), got {type(curv).__name__}."
        )
    return curv


def _invert(avg: Curvature, lam: Array, damping: AbstractDamping) -> Curvature:
    blocks = {k: damping.precompute(b, lam) for k, b in avg.blocks.items()}
    return Curvature(blocks, avg.leaf_indices, avg.structure, avg.leaf_slices)


def _initial(like: Curvature, lam: Array, damping: AbstractDamping) -> KFACState:
    zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), like)
    # `ema` drops cached eigendecompositions: the average has `ema`'s structure.
    avg = zeros.ema(zeros, 0.0)
    zero = jnp.zeros((), jnp.int32)
    return KFACState(zero, zero, zero, zero, zero, avg, _invert(avg, lam, damping))


def _fold(
    state: KFACState,
    curvature: Curvature,
    lam: Array,
    decay: float,
    inverse_every: int,
    damping: AbstractDamping,
) -> KFACState:
    """Averages `curvature` in and refreshes the cached inverse when due."""
    if jax.tree_util.tree_structure(curvature) != jax.tree_util.tree_structure(
        state.curvature
    ) or [jnp.shape(x) for x in jax.tree_util.tree_leaves(curvature)] != [
        jnp.shape(x) for x in jax.tree_util.tree_leaves(state.curvature)
    ]:
        raise ValueError(
            "`kfac_preconditioner.update(..., curvature=...)`: the curvature has "
            "other blocks or shapes than the optimiser's `like=`; build `like` with "
            "`eqfisher.optim.curvature_like` from the same function and model."
        )
    finite = _all_finite(curvature)
    n_good = state.curvature_count + finite.astype(jnp.int32)
    # The time-varying decay makes this the bias-corrected average of each factor.
    t = n_good.astype(jnp.float32)
    d = decay * (1 - decay ** (t - 1)) / (1 - decay**t)
    d = jnp.clip(jnp.where(n_good > 1, d, 0.0), 0.0, 1.0)
    avg = _where(finite, state.curvature.ema(curvature, d), state.curvature)
    # Early estimates change fast: refresh at each of the first `inverse_every`
    # estimates, then at every `inverse_every`-th.
    refresh = finite & ((n_good <= inverse_every) | (n_good % inverse_every == 0))

    def refreshed():
        new = _invert(avg, lam, damping)
        # An inverse that came out non-finite is not cached: the old one is kept.
        return _where(_all_finite(new), new, state.inverse)

    inverse = jax.lax.cond(refresh, refreshed, lambda: state.inverse)
    return state._replace(
        curvature_count=n_good,
        nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        refresh_count=state.refresh_count + refresh.astype(jnp.int32),
        curvature=avg,
        inverse=inverse,
    )


def _precondition(updates: PyTree, state: KFACState) -> PyTree:
    try:
        direction = state.inverse.mv(updates)
    except ValueError as e:
        raise ValueError(
            "`kfac_preconditioner.update`: the gradients and the curvature cover "
            "different parameters. For a curvature built with `where=`, wrap the "
            "optimiser in `optax.masked(..., eqfisher.filters.optax_mask(model, "
            "where))`."
        ) from e
    # No finite curvature seen yet: no step rather than an unpreconditioned one.
    return jax.tree_util.tree_map(
        lambda x: jnp.where(state.curvature_count > 0, x, jnp.zeros_like(x)), direction
    )


def _constrain(direction, grads, constraint, learning_rate):
    """Scales `direction` Δ so that lr²·Δᵀg ≤ `constraint` (Δᵀg ≈ ΔᵀCΔ: the step's
    squared length in the curvature metric), as kfac_jax's `norm_constraint`."""
    inner = optax.tree_utils.tree_vdot(direction, grads)
    lr = jnp.asarray(learning_rate).astype(jnp.result_type(inner))
    size = lr**2 * jnp.maximum(inner, 0.0)
    scale = jnp.minimum(1.0, jnp.sqrt(constraint / jnp.maximum(size, 1e-30)))
    return jax.tree_util.tree_map(lambda d: (scale * d).astype(d.dtype), direction)


def _guard(direction: PyTree, state: KFACState) -> tuple[PyTree, KFACState]:
    """A non-finite update (NaN gradients, a blown-up inverse) becomes no step."""
    ok = _all_finite(direction)
    direction = jax.tree_util.tree_map(
        lambda x: jnp.where(ok, x, jnp.zeros_like(x)), direction
    )
    state = state._replace(
        count=state.count + 1,
        skipped_count=state.skipped_count + (~ok).astype(jnp.int32),
    )
    return direction, state


def kfac_preconditioner(
    *,
    like: Curvature,
    damping: ScalarOrSchedule = DAMPING,
    decay: float = 0.95,
    inverse_every: int = INVERSE_EVERY,
    damping_variant: AbstractDamping = PI_DAMPING,
    norm_constraint: float | None = NORM_CONSTRAINT,
    learning_rate: ScalarOrSchedule = 1.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Preconditions gradients by a damped, averaged curvature.

    The update is $(C + \lambda I)^{-1} g$, with $C$ the averaged curvature.

    **Arguments:**

    - `like`: a `Curvature` of the shape `update` will receive (real, or from
      `curvature_like`): `init` builds the averaged curvature (zeros) and its
      cached inverse from it, so the state never changes structure.
    - `damping`: $\lambda > 0$, a float or an optax schedule of the step count; the
      value at a refresh of the cached inverse is used until the next refresh.
    - `decay`: the moving-average weight of old curvature, in [0, 1).
    - `inverse_every`: refresh the cached inverse at every this-many-th curvature
      estimate (inside jit; no recompilation), and at each of the first
      `inverse_every`, while the average is young.
    - `damping_variant`: `FactoredTikhonov()` (default, π-damping as kfac_jax)
      or `Tikhonov()` (exact $(\bar C + \lambda I)^{-1}$ for the averaged K-FAC
      matrix).
    - `norm_constraint`: $c > 0$ or `None`: the direction $\Delta$ is scaled down so
      that $\text{lr}^2 \Delta^\top g \le c$, a trust region on the step's length in
      the curvature metric (kfac_jax's `norm_constraint`). On by default: it keeps
      large learning rates finite early on, when the curvature is poorly known.
    - `learning_rate`: the rate the caller applies afterwards (a float or an optax
      schedule), used only by `norm_constraint`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`. `update(grads, state, params,
    curvature=curv)` averages `curv` in and preconditions; `update(grads, state,
    params)` (no curvature) only preconditions with the cached inverse, for steps
    between curvature estimates. A curvature holding NaN or inf is not averaged in
    (counted in `state.nonfinite_count`); a non-finite update is replaced by zero
    (counted in `state.skipped_count`).

    !!! Example

        With exact damping and no norm constraint, the direction is
        $(C + \lambda I)^{-1} g$ after one curvature estimate; a learning rate
        turns it into an optimiser:

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        pre = ef.optim.kfac_preconditioner(
            like=curv,
            damping=0.1,
            damping_variant=ef.optim.Tikhonov(),
            norm_constraint=None,
        )
        direction, _ = pre.update(grads, pre.init(params), params, curvature=curv)
        expected = curv.solve(grads, 0.1)
        for a, b in zip(jax.tree.leaves(direction), jax.tree.leaves(expected)):
            assert jnp.allclose(a, b, atol=1e-5)

        opt = optax.chain(pre, optax.scale_by_learning_rate(0.5))
        updates, _ = opt.update(grads, opt.init(params), params, curvature=curv)
        stepped = eqx.apply_updates(model, updates)
        assert loss_fn(stepped, batch) < loss_fn(model, batch)
        ```
    """
    caller = "kfac_preconditioner"
    _check_like(caller, like)
    _check(caller, "damping", damping, 0.0, None, False)
    _check(caller, "decay", decay, 0.0, 1.0, True)
    _check_positive_int(caller, "inverse_every", inverse_every)
    if norm_constraint is not None:
        _check(caller, "norm_constraint", norm_constraint, 0.0, None, False)

    def init(params):
        del params
        return _initial(
            like, _value(damping, jnp.zeros((), jnp.int32)), damping_variant
        )

    def update(updates, state, params=None, *, curvature=None, **extra):
        del params, extra
        if curvature is not None:
            lam = _value(damping, state.count)
            state = _fold(state, curvature, lam, decay, inverse_every, damping_variant)
        direction = _precondition(updates, state)
        if norm_constraint is not None:
            lr = _value(learning_rate, state.count)
            direction = _constrain(direction, updates, norm_constraint, lr)
        return _guard(direction, state)

    return optax.GradientTransformationExtraArgs(init, update)


def kfac(
    learning_rate: ScalarOrSchedule,
    *,
    like: Curvature,
    damping: ScalarOrSchedule = DAMPING,
    momentum: float = MOMENTUM,
    decay: float = 0.95,
    inverse_every: int = INVERSE_EVERY,
    weight_decay: float = 0.0,
    damping_variant: AbstractDamping = PI_DAMPING,
    norm_constraint: float | None = NORM_CONSTRAINT,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC, ready to use: preconditioner, weight decay, momentum, learning rate.

    **Arguments:**

    - `learning_rate`: a float or an optax schedule; the only option to tune.
    - `like`, `damping`, `decay`, `inverse_every`, `damping_variant`,
      `norm_constraint`: see `kfac_preconditioner`. The defaults: `damping=1e-3`,
      `momentum=0`, `decay=0.95`, `inverse_every=5`, `FactoredTikhonov()`
      (π-damping), `norm_constraint=1e-2` (chosen by `benchmarks/kfac_defaults.py`).
    - `momentum`: heavy-ball momentum on the preconditioned direction (0 for none).
    - `weight_decay`: added to the preconditioned direction, decoupled as in AdamW.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` (it composes with `optax.chain`,
    `optax.clip_by_global_norm`, `optax.masked`); call
    `opt.update(grads, state, params, curvature=curv)`, or use `kfac_step`.

    **Raises:**

    `ValueError` (or `TypeError`) when `like` is not a `Curvature`, when
    `damping`, `decay` or `norm_constraint` is out of range, or when
    `inverse_every` is not a positive integer; at `update`, a `ValueError` when
    `curvature=` has other blocks or shapes than `like`.

    !!! Example

        ```python
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )
        like = ef.optim.curvature_like(vgc, model, batch, key=key)
        opt = ef.optim.kfac(0.1, like=like)
        state = opt.init(params)
        loss, grads, curv = vgc(model, batch, key=key)
        updates, state = opt.update(grads, state, params, curvature=curv)
        model = eqx.apply_updates(model, updates)
        ```
    """
    parts = [
        kfac_preconditioner(
            like=like,
            damping=damping,
            decay=decay,
            inverse_every=inverse_every,
            damping_variant=damping_variant,
            norm_constraint=norm_constraint,
            learning_rate=learning_rate,
        )
    ]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    if not (isinstance(momentum, (int, float)) and momentum == 0):
        # An array momentum (e.g. one swept under `vmap`) always gets the trace.
        parts.append(optax.trace(decay=momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


def find_kfac_state(state: PyTree) -> KFACState:
    """The `KFACState` inside an optimiser state (e.g. an `optax.chain`'s).

    **Arguments:**

    - `state`: an optimiser state holding exactly one `KFACState`.

    **Returns:**

    That `KFACState`.

    **Raises:**

    `ValueError` when `state` holds no `KFACState`, or more than one.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        kfac = ef.optim.kfac(0.1, like=curv)
        opt = optax.chain(optax.clip_by_global_norm(1.0), kfac)
        kstate = ef.optim.find_kfac_state(opt.init(params))
        assert isinstance(kstate, ef.optim.KFACState) and kstate.count == 0
        ```
    """
    found = [
        s
        for s in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, KFACState)
        )
        if isinstance(s, KFACState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"`find_kfac_state(state)`: `state` holds {len(found)} K-FAC states; "
            "expected one (from `kfac`, `kfac_preconditioner` or `kfac_adaptive`)."
        )
    return found[0]


def curvature_ok(state: PyTree) -> Array:
    """True when no curvature estimate has been rejected as non-finite.

    **Raises:**

    `ValueError` when `state` holds no `KFACState`.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac(0.1, like=curv)
        _, state = opt.update(grads, opt.init(params), params, curvature=curv)
        assert ef.optim.curvature_ok(state)
        broken = jax.tree.map(lambda a: a * jnp.nan, curv)
        _, state = opt.update(grads, state, params, curvature=broken)
        assert not ef.optim.curvature_ok(state)  # rejected, not averaged in
        ```
    """
    try:
        return find_kfac_state(state).nonfinite_count == 0
    except ValueError:
        raise ValueError(
            "`curvature_ok(state)`: no K-FAC state found in `state`."
        ) from None


def _leading(batch: PyTree, size: int | None) -> PyTree:
    """The first `size` examples of every leaf of `batch` (all when `None`)."""
    if size is None:
        return batch
    return jax.tree_util.tree_map(lambda x: x[:size], batch)


def _every(period: int, opt_state: PyTree, due: Callable, otherwise: Callable):
    """`due()` at every `period`-th step (by the K-FAC state's count, chosen with
    `lax.cond` inside jit), `otherwise()` at the others."""
    if period == 1:
        return due()
    count = find_kfac_state(opt_state).count
    return jax.lax.cond(count % period == 0, due, otherwise)


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
    curvature_update_period: int = CURVATURE_UPDATE_PERIOD,
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
    _check_positive_int(caller, "curvature_update_period", curvature_update_period)
    if curvature_batch_size is not None:
        _check_positive_int(caller, "curvature_batch_size", curvature_batch_size)
    vgc = value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    value_and_grad = eqx.filter_value_and_grad(loss_fn)

    @eqx.filter_jit
    def step(model, opt_state, batch, key=None):
        params = eqx.filter(model, eqx.is_inexact_array)
        period = curvature_update_period
        if _shares_forward(loss_fn, model, batch, period, curvature_batch_size):

            def statistics():
                loss, grads, curv = vgc(model, batch, key=key)
                return loss, *optimiser.update(grads, opt_state, params, curvature=curv)

            def plain():
                loss, grads = value_and_grad(model, batch)
                return loss, *optimiser.update(grads, opt_state, params)

            loss, updates, opt_state = _every(period, opt_state, statistics, plain)
        else:
            loss, grads = value_and_grad(model, batch)
            sub = _leading(batch, curvature_batch_size)
            updates, opt_state = _every(
                period,
                opt_state,
                lambda: optimiser.update(
                    grads, opt_state, params, curvature=vgc(model, sub, key=key)[2]
                ),
                lambda: optimiser.update(grads, opt_state, params),
            )
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


class AdaptiveKFACState(NamedTuple):
    r"""State of `kfac_adaptive`: the preconditioner's and the step rule's.

    - `kfac`: the `KFACState` (averaged curvature, cached inverse, counters).
    - `steps`: the step rule's: `damping` (the current $\lambda$), `previous` (the
      last update), `count`, and `rho` (the last reduction ratio).

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
    initial_damping: float = 1.0,
    decay: float = 0.95,
    inverse_every: int = 1,
    adapt_every: int = 5,
    weight_decay: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    r"""K-FAC with the learning rate, momentum and damping chosen automatically.

    Each step minimises the exact Gauss-Newton quadratic model over
    $\alpha \Delta + \mu \delta_{-1}$ ($\Delta = -(\bar C + \lambda I)^{-1} g$ the
    preconditioned direction, $\delta_{-1}$ the last update), and every
    `adapt_every` steps adapts the damping $\lambda$ by the Levenberg–Marquardt rule
    on the ratio of the actual to the predicted loss reduction (Martens & Grosse
    2015). Meant for large batches: the model is that of one batch.

    **Arguments:**

    - `like`: see `kfac_preconditioner`.
    - `initial_damping`: the first $\lambda > 0$.
    - `decay`: see `kfac_preconditioner`.
    - `inverse_every`: as in `kfac_preconditioner`; $\lambda$ changes take effect at
      the next refresh (with the default 1, at once).
    - `adapt_every`: steps between Levenberg–Marquardt adaptations.
    - `weight_decay`: added to the gradient before preconditioning.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; call `update(grads, state, params,
    curvature=curv, quadratic=eqfisher.optim.quadratic_model(loss_fn, model,
    batch))`. The result is the full update (no learning rate to apply).

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
    _check_like(caller, like)
    _check(caller, "initial_damping", initial_damping, 0.0, None, False)
    _check(caller, "decay", decay, 0.0, 1.0, True)
    _check_positive_int(caller, "inverse_every", inverse_every)
    steps = adaptive_steps(initial_damping=initial_damping, adapt_every=adapt_every)
    exact = Tikhonov()

    def init(params):
        lam = jnp.asarray(initial_damping)
        return AdaptiveKFACState(_initial(like, lam, exact), steps.init(params))

    def update(updates, state, params=None, *, curvature=None, quadratic=None, **extra):
        del extra
        if weight_decay:
            updates = jax.tree_util.tree_map(
                lambda g, p: g + weight_decay * p, updates, params
            )
        kstate = state.kfac
        if curvature is not None:
            lam = state.steps.damping
            kstate = _fold(kstate, curvature, lam, decay, inverse_every, exact)
        direction, kstate = _guard(_precondition(updates, kstate), kstate)
        delta = jax.tree_util.tree_map(jnp.negative, direction)
        step, sstate = steps.update(
            delta, state.steps, params, quadratic=quadratic, grads=updates
        )
        return step, AdaptiveKFACState(kstate, sstate)

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = [
    "AbstractDamping",
    "AdaptiveKFACState",
    "FactoredTikhonov",
    "KFACState",
    "QuadraticModel",
    "Tikhonov",
    "curvature_like",
    "curvature_ok",
    "find_kfac_state",
    "kfac",
    "kfac_adaptive",
    "kfac_preconditioner",
    "kfac_step",
    "quadratic_model",
    "tikhonov_inverse",
]
