"""K-FAC as optax transformations: the preconditioner and the optimiser."""

import functools
from collections.abc import Callable

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Int, PyTree, ScalarLike

from .._curvature import Curvature
from .._refusal import refused_where
from ..blocks._base import scalars_checked
from ._damping import AbstractDamping, FactoredTikhonov
from ._flat import flatten_if_small
from ._graft import graft as grafted
from ._momentum import in_gradient_dtypes, momentum as kept_momentum
from ._state import (
    KFACState,
    ScalarOrSchedule,
    all_finite,
    branch,
    check_preconditioner_args,
    check_range,
    checked_at,
    checked_in_range,
    choose_tree,
    dtype_mismatch,
    float_type,
    is_constant,
    is_constant_zero,
    like_mismatch,
    placed,
    require_estimate,
    sum_squares,
    value_at,
    where_tree,
)


def _check_params(caller: str, call: str, params: PyTree, name: str = "params") -> None:
    """Refuses `params` (or the `updates`) with leaves that are not floating-point
    arrays (the model passed whole: its activations and other static fields; an
    integer leaf of `eqx.filter(model, eqx.is_array)`), naming the fix."""
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float))
        or not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if paths:
        fix = (
            "the gradients, shaped as `eqx.filter(model, eqx.is_inexact_array)`"
            if name == "updates"
            else "`eqx.filter(model, eqx.is_inexact_array)`, not the model"
        )
        raise TypeError(
            f"`eqfisher.optim.{caller}(...).{call}`: `{name}` must hold "
            f"floating-point arrays only, but has another leaf at {paths[0]}; pass "
            f"{fix}."
        )


def _invert(avg: Curvature, lam: Array, damping: AbstractDamping) -> Curvature:
    # `lam` was checked when it was read (`damping_at`).
    with scalars_checked():
        return damping.invert(avg, lam)


@functools.partial(jax.jit, static_argnums=0)
def _zeros_of(specs: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> list[Array]:
    return [jnp.zeros(shape, dtype) for shape, dtype in specs]


def _zeros(*trees: PyTree) -> list[PyTree]:
    """Zeros shaped as `trees`' leaves, made by one compiled program: called
    eagerly, `init` otherwise compiled a program per distinct shape (0.1 s of its
    0.2 s on a three-layer MLP)."""
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    specs = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
    return list(jax.tree_util.tree_unflatten(treedef, _zeros_of(specs)))


def initial_state(like: Curvature, lam: Array, damping: AbstractDamping) -> KFACState:
    # `ema` drops cached eigendecompositions: the average has `ema`'s structure.
    avg = jax.eval_shape(lambda c: c.ema(c, 0.0), like)
    # The cached inverse's structure, without factorising anything: it is not used
    # before the first finite estimate (`precondition` gives no step until then),
    # and that estimate always refreshes it (`fold`).
    inverse = jax.eval_shape(lambda c: _invert(c, lam, damping), avg)
    # Five counters, five arrays: one array in five leaves is one buffer, which a
    # step that donates its state (`kfac_step(..., donate=True)`) gave XLA five
    # times ("Attempt to donate the same buffer twice", then a crash).
    counter = jax.ShapeDtypeStruct((), jnp.int32)
    c0, c1, c2, c3, c4, avg, inverse = _zeros(*[counter] * 5, avg, inverse)
    return KFACState(c0, c1, c2, c3, c4, avg, inverse)


def _checked_inverse_every(caller: str, inverse_every, carrier: Array) -> Array:
    """`carrier`, after checking `inverse_every` where it is traced (set through
    `optax.inject_hyperparams`'s state: a constant is checked when the optimiser is
    built)."""
    if not isinstance(inverse_every, jax.core.Tracer):
        return carrier
    return refused_where(
        carrier,
        inverse_every < 1,
        f"`eqfisher.optim.{caller}(..., inverse_every=...)`: `inverse_every` must be "
        "a positive integer at every update (a value set in "
        "`optax.inject_hyperparams`'s state?).",
    )


def fold(
    caller: str,
    state: KFACState,
    curvature: Curvature,
    lam: Array,
    decay: ScalarLike,
    inverse_every: int | Int[Array, ""],
    damping: AbstractDamping,
) -> KFACState:
    """Averages `curvature` in and refreshes the cached inverse when due."""
    if jax.tree_util.tree_structure(curvature) != jax.tree_util.tree_structure(
        state.curvature
    ) or [jnp.shape(x) for x in jax.tree_util.tree_leaves(curvature)] != [
        jnp.shape(x) for x in jax.tree_util.tree_leaves(state.curvature)
    ]:
        what = like_mismatch(state.curvature, curvature)
        raise ValueError(
            f"`eqfisher.optim.{caller}(...).update(..., curvature=...)`: the "
            "curvature has "
            "other blocks or shapes than the optimiser's `like=`"
            + (f": {what}" if what else "")
            + "; build `like` with `eqfisher.optim.curvature_like` from the same "
            "function and model."
        )
    mismatch = dtype_mismatch(state.curvature, curvature, "the state's average")
    if mismatch:
        raise ValueError(
            f"`eqfisher.optim.{caller}(...).update(..., curvature=...)`: {mismatch}."
        )
    finite = all_finite(curvature)
    decay = checked_in_range(caller, "decay", decay, 0.0, 1.0)
    n_good = _checked_inverse_every(
        caller, inverse_every, state.curvature_count + finite.astype(jnp.int32)
    )
    # The time-varying decay makes this the bias-corrected average of each factor,
    # its weights in the curvature's precision (float64 for float64 factors).
    floats = [
        x
        for x in jax.tree_util.tree_leaves(curvature)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    t = n_good.astype(float_type(floats) if floats else jnp.float32)
    d = decay * (1 - decay ** (t - 1)) / (1 - decay**t)
    d = jnp.clip(jnp.where(n_good > 1, d, 0.0), 0.0, 1.0)
    with scalars_checked():  # `d` is clipped to [0, 1]
        ema = state.curvature.ema(curvature, d)
    avg = where_tree(finite, ema, state.curvature)
    # Early estimates change fast: refresh at each of the first `inverse_every`
    # estimates, then at every `inverse_every`-th.
    if isinstance(inverse_every, jax.Array):  # a strong int64 would not promote
        inverse_every = inverse_every.astype(n_good.dtype)
    refresh = finite & ((n_good <= inverse_every) | (n_good % inverse_every == 0))

    def refreshed():
        new = _invert(avg, lam, damping)
        # An inverse that came out non-finite is not cached: the old one is kept.
        return choose_tree(all_finite(new), new, state.inverse)

    inverse = branch(refresh, refreshed, lambda: state.inverse)
    return state._replace(
        curvature_count=n_good,
        nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        refresh_count=state.refresh_count + refresh.astype(jnp.int32),
        curvature=avg,
        inverse=inverse,
    )


def receive(
    caller: str,
    updates: PyTree,
    state: KFACState,
    curvature: Curvature | Callable[[], Curvature] | None,
    due: ArrayLike | None,
    fold_in: Callable[[KFACState, Curvature], KFACState],
) -> tuple[PyTree, KFACState]:
    """`(updates, state)` after an update's `curvature=` and `curvature_due=`:
    `fold_in(state, curvature)` folds an estimate in; without one (no
    `curvature`, or `due` False) the updates are checked to follow an estimate
    (`require_estimate`). A function `curvature` is called where the estimate is
    folded in: inside the `lax.cond` on `due`, so computed only when due. An int
    `due`, k, is due at every k-th update by the state's own count, from the
    first: no update can come before an estimate, so none is checked."""
    if curvature is None:
        if due is not None:
            raise ValueError(
                f"`eqfisher.optim.{caller}(...).update(..., curvature_due=...)` "
                "needs `curvature=`: the curvature, or a function returning it."
            )
        return require_estimate(caller, updates, state), state

    def folded() -> KFACState:
        return fold_in(state, curvature() if callable(curvature) else curvature)

    if due is None:
        return updates, folded()
    argument = f"`eqfisher.optim.{caller}(...).update(..., curvature_due=...)`"
    # A Python or NumPy bool says whether due; an int is a period.
    if isinstance(due, (int, np.integer)) and not isinstance(due, (bool, np.bool_)):
        if due < 1:
            raise ValueError(
                f"{argument}: an int is a period, every k-th update: k >= 1, got {due}."
            )
        period = int(due)
        return updates, branch(state.count % period == 0, folded, lambda: state)
    due = jnp.asarray(due)
    if due.shape != () or due.dtype != jnp.bool_:
        # `lax.cond` would read a nonzero integer array as true.
        raise TypeError(
            f"{argument}: a boolean scalar (whether an estimate is due) or a "
            f"positive int (a period), got an array of {due.dtype}{list(due.shape)}."
        )
    updates = require_estimate(caller, updates, state, unless=due)
    # Between estimates the average is passed through, not recomputed and selected.
    return updates, branch(due, folded, lambda: state)


def precondition(caller: str, updates: PyTree, state: KFACState) -> PyTree:
    # No finite curvature seen yet: no step rather than an unpreconditioned one.
    # The gradients are zeroed, not the direction: the cached inverse is finite
    # (zeros before the first estimate), so its `mv` of zeros is zero, and the
    # select fuses into the `mv`'s operands instead of a kernel per leaf after it.
    seen = state.curvature_count > 0
    updates = jax.tree_util.tree_map(
        lambda x: jnp.where(seen, x, jnp.zeros_like(x)), updates
    )
    try:
        return state.inverse.mv(updates)
    except ValueError as e:
        raise ValueError(
            f"`eqfisher.optim.{caller}(...).update`: the gradients and the "
            "curvature cover different parameters. For a curvature built with "
            "`where=`, give K-FAC only those gradients and the rest to another "
            "optimiser: `optax.chain(optax.masked(kfac, mask), "
            "optax.masked(other, rest))` with `mask = "
            "eqfisher.filters.optax_mask(model, where)` and `rest` its negation, "
            "or as in docs/optim.md's `where=` example. Not `optax.masked(kfac, "
            "mask)` alone: it passes the other gradients through unchanged as "
            "updates, a step up the gradient."
        ) from e


def _constrain(direction, grads, constraint, learning_rate) -> tuple[PyTree, Array]:
    """`direction` Δ scaled by min(1, √(`constraint` / (lr²·Δᵀg))), so that the
    step's squared length in the curvature metric, lr²·ΔᵀCΔ (= lr²·Δᵀg before the
    scaling, Δ = C⁻¹g), is at most `constraint`, as kfac_jax's `norm_constraint`; and
    whether the result is finite (for `guard`). Δᵀg, one reduction per leaf, is
    the test: a NaN or inf in Δ makes it non-finite (inf · 0 is NaN), and the
    scaled Δ is finite when it is (an overflowing Δᵀg gives scale 0)."""
    inner = optax.tree_utils.tree_vdot(direction, grads)
    lr = jnp.asarray(learning_rate).astype(jnp.result_type(inner))
    size = lr**2 * jnp.maximum(inner, 0.0)
    scale = jnp.minimum(1.0, jnp.sqrt(constraint / jnp.maximum(size, 1e-30)))
    scaled = jax.tree_util.tree_map(lambda d: (scale * d).astype(d.dtype), direction)
    return scaled, jnp.isfinite(inner) & jnp.isfinite(scale)


def guard(
    direction: PyTree, state: KFACState, ok: Array | None = None, zero: bool = True
) -> tuple[PyTree, KFACState]:
    """A non-finite update (NaN gradients, a blown-up inverse) becomes no step;
    `ok`: whether `direction` is finite, when known (else computed here). With
    `zero=False` it is only counted: for a caller that zeroes a non-finite update
    itself (`graft` does, fused into its own step)."""
    if ok is None:
        ok = all_finite(direction)
    if zero:
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
    damping: ScalarOrSchedule = 1e-3,
    decay: ScalarLike = 0.95,
    inverse_every: int | Int[Array, ""] = 5,
    damping_variant: AbstractDamping = FactoredTikhonov(),  # noqa: B008 (an immutable Module)
    norm_constraint: float | int | None = 1e-2,
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
    - `norm_constraint`: $c > 0$ or `None`: the direction $\Delta$ is scaled by
      $\min\bigl(1, \sqrt{c / (\text{lr}^2 \Delta^\top g)}\bigr)$, so that the
      step's squared length in the curvature metric $C$ (the damped average),
      $\text{lr}^2 \Delta^\top C \Delta$, is at most $c$ (for $\Delta = C^{-1} g$,
      $\Delta^\top C \Delta = \Delta^\top g$): a trust region, as kfac_jax's
      `norm_constraint`. On by default: it keeps
      large learning rates finite early on, when the curvature is poorly known.
    - `learning_rate`: the rate the caller applies afterwards (a float or an optax
      schedule), used only by `norm_constraint`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`. `update(grads, state, params,
    curvature=curv)` averages `curv` in and preconditions; `update(grads, state,
    params)` (no curvature) only preconditions with the cached inverse, for steps
    between curvature estimates. `update(grads, state, params, curvature=curv,
    curvature_due=due)`, with `due` a boolean array, is the first where `due` is
    true and the second (`curv` a placeholder, e.g. zeros) where it is false:
    chosen inside jit without tracing the update twice. `due` may also be a
    positive int k: due at every k-th update by the state's own count (`count %
    k == 0`), the first included, so no check that an estimate came first is
    compiled in. `curv` may also be a function of no arguments returning the
    curvature: it is called inside the `lax.cond` on `due` (or at once without
    `curvature_due`), so the statistics are computed only at the steps that use
    them, as `kfac_step` does. A
    curvature holding NaN or inf is not averaged in
    (counted in `state.nonfinite_count`); a non-finite update is replaced by zero
    (counted in `state.skipped_count`).

    **Raises:**

    `ValueError` (or `TypeError`) for arguments out of range (see `kfac`). At
    `update`, a `TypeError` for a `curvature_due` that is an array but not a
    boolean scalar, a `ValueError` for an int below 1. At `update` (under `jit`,
    Equinox's runtime error): an update without
    `curvature=` before any curvature has been received (K-FAC is not a plain
    optax optimiser: it needs curvature estimates), and a `damping` schedule
    value that is not finite and positive or a `learning_rate` schedule value
    that is not finite and non-negative.

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
    return placed(
        _preconditioner(
            "kfac_preconditioner",
            like=like,
            damping=damping,
            decay=decay,
            inverse_every=inverse_every,
            damping_variant=damping_variant,
            norm_constraint=norm_constraint,
            learning_rate=learning_rate,
        )
    )


def _check_damping_variant(caller: str, damping_variant) -> None:
    """Refuses a `damping_variant` that is no damping instance when the optimiser
    is built (a string or a class failed at `init`, naming neither)."""
    if isinstance(damping_variant, AbstractDamping):
        return
    hint = (
        f": call it, `{damping_variant.__name__}()`"
        if isinstance(damping_variant, type)
        and issubclass(damping_variant, AbstractDamping)
        else ""
    )
    raise TypeError(
        f"`eqfisher.optim.{caller}(..., damping_variant=...)`: expected an "
        "`eqfisher.optim.AbstractDamping` instance (`FactoredTikhonov()`, the "
        f"default, or `Tikhonov()`), got {damping_variant!r}{hint}."
    )


def _preconditioner(
    caller: str,
    *,
    like: Curvature,
    damping: ScalarOrSchedule,
    decay: ScalarLike,
    inverse_every: int | Int[Array, ""],
    damping_variant: AbstractDamping,
    norm_constraint: float | int | None,
    learning_rate: ScalarOrSchedule,
    zero_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """`kfac_preconditioner`, with `caller` (the public function called) named in
    its errors; `zero_nonfinite=False` leaves a non-finite direction as it is
    (still counted in `skipped_count`, as is one whose sum of squares overflows),
    for `graft`, which gives either no step."""
    check_preconditioner_args(caller, like, "damping", damping, decay, inverse_every)
    _check_damping_variant(caller, damping_variant)
    check_range(caller, "learning_rate", learning_rate, 0.0, None, True)
    if norm_constraint is not None:
        check_range(caller, "norm_constraint", norm_constraint, 0.0, None, False)

    def damping_at(count):
        lam = value_at(damping, count)
        if is_constant(damping):  # checked when built: no check traced per step
            return lam
        return checked_at(caller, "damping", lam, lam, allow_zero=False)

    def init(params):
        _check_params(caller, "init(params)", params)
        return initial_state(
            like, damping_at(jnp.zeros((), jnp.int32)), damping_variant
        )

    def fold_in(state, curvature):
        lam = damping_at(state.count)
        return fold(
            caller, state, curvature, lam, decay, inverse_every, damping_variant
        )

    def update(
        updates, state, params=None, *, curvature=None, curvature_due=None, **extra
    ):
        del extra
        call = "update(updates, state, params)"
        _check_params(caller, call, updates, "updates")
        if params is not None:
            _check_params(caller, call, params)
        updates, state = receive(
            caller, updates, state, curvature, curvature_due, fold_in
        )
        direction = precondition(caller, updates, state)
        lr = value_at(learning_rate, state.count)
        if not is_constant(learning_rate):  # a constant was checked when built
            # Attached to the count the state carries out, not to the direction:
            # the check's `cond` then passes one scalar through, not every leaf
            # (a copy each per step, and a kernel each to compile).
            count = checked_at(
                caller, "learning_rate", lr, state.count, allow_zero=True
            )
            state = state._replace(count=count)
        ok = None
        if norm_constraint is not None:
            direction, ok = _constrain(direction, updates, norm_constraint, lr)
        elif not zero_nonfinite:
            # For `graft`, which reduces the same sums of squares for its norms
            # (XLA computes them once) and gives no step where one is not finite.
            squares = sum_squares(jax.tree_util.tree_leaves(direction))
            ok = jnp.all(jnp.isfinite(squares))
        return guard(direction, state, ok, zero=zero_nonfinite)

    # optax types a state as an array tree; this one holds Curvatures (pytrees too).
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def kfac(
    learning_rate: ScalarOrSchedule,
    *,
    like: Curvature,
    damping: ScalarOrSchedule = 3e-5,
    momentum: ScalarLike = 0.0,
    decay: ScalarLike = 0.95,
    inverse_every: int | Int[Array, ""] = 10,
    weight_decay: float | int | Array = 0.0,
    damping_variant: AbstractDamping = FactoredTikhonov(),  # noqa: B008 (an immutable Module)
    graft: optax.GradientTransformation | None = flatten_if_small(  # noqa: B008 (stateless)
        optax.scale_by_adam()  # noqa: B008
    ),
    norm_constraint: float | int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC, ready to use: preconditioner, grafting, weight decay, momentum,
    learning rate.

    **Arguments:**

    - `learning_rate`: a float or an optax schedule; the only option to tune.
      With the default `graft`, it is on Adam's scale (each leaf steps as far as
      Adam at this rate would step it): start from a rate that suits Adam and
      sweep up (on the five benchmark problems the best was three times
      Adam's).
    - `like`, `damping`, `decay`, `inverse_every`, `damping_variant`: see
      `kfac_preconditioner`. The defaults: `damping=3e-5`, `momentum=0`,
      `decay=0.95`, `inverse_every=10`, `FactoredTikhonov()` (π-damping; factors
      wider than 1024 inverted by their diagonal blocks), `graft=
      flatten_if_small(optax.scale_by_adam())` (chosen by
      `benchmarks/kfac_grid.py`, in benchmarks/RESULTS.md; Adam's moments kept
      as one vector for a model of at most $2^{17}$ parameters of one dtype, the
      same steps in fewer kernels, see `flatten_if_small`).
    - `graft`: a transformation, or `None`. With one, each parameter leaf's
      K-FAC direction is rescaled to the length of that transformation's update
      for the leaf (see `graft`): the curvature chooses the direction, Adam by
      default the step length. `None` gives the plain preconditioned direction,
      times the learning rate.
    - `norm_constraint`: with `graft=None`, see `kfac_preconditioner` (`1e-2` is
      the value measured without grafting); `None` (default) for none. Grafting
      sets every leaf's length itself, so the two are refused together.
    - `momentum`: heavy-ball momentum on the (grafted) direction (0 for none).
    - `weight_decay`: added to the (grafted) direction, decoupled as in AdamW.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` (it composes with `optax.chain`,
    `optax.clip_by_global_norm`, `optax.masked`); call
    `opt.update(grads, state, params, curvature=curv)`, or use `kfac_step`.

    **Raises:**

    `ValueError` (or `TypeError`) when `like` is not a `Curvature`, when
    `learning_rate`, `damping`, `decay` or `norm_constraint` is out of range,
    when `inverse_every` is not a positive integer, or when both `graft` and
    `norm_constraint` are given; at `update`, a `ValueError`
    when `curvature=` has other blocks or shapes than `like`. At `update` too
    (under `jit`, Equinox's runtime error): an update without `curvature=` before
    any curvature has been received, and schedule values out of range (`damping`
    not finite and positive, `learning_rate` not finite and non-negative).

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
    if graft is not None and norm_constraint is not None:
        raise ValueError(
            "`eqfisher.optim.kfac(..., graft=..., norm_constraint=...)`: grafting "
            "sets each leaf's step length, so a norm constraint would do nothing; "
            "pass `norm_constraint=None` to graft, or `graft=None` to constrain the "
            "plain K-FAC step."
        )
    if graft is not None and not isinstance(graft, optax.GradientTransformation):
        raise TypeError(
            "`eqfisher.optim.kfac(..., graft=...)` takes an optax transformation "
            "(e.g. `optax.scale_by_adam()`) or `None`; got "
            f"{type(graft).__name__}."
        )
    # Applied after the preconditioner's finite guard: a NaN here is a NaN model.
    weight_decay = checked_in_range("kfac", "weight_decay", weight_decay, 0.0, None)
    momentum = checked_in_range("kfac", "momentum", momentum, 0.0, 1.0)
    preconditioner = _preconditioner(
        "kfac",
        like=like,
        damping=damping,
        decay=decay,
        inverse_every=inverse_every,
        damping_variant=damping_variant,
        norm_constraint=norm_constraint,
        learning_rate=learning_rate,
        # The graft gives a direction holding NaN or inf no step itself.
        zero_nonfinite=graft is None,
    )
    parts: list[optax.GradientTransformation] = [
        preconditioner if graft is None else grafted(preconditioner, graft)
    ]
    if not is_constant_zero(weight_decay):
        parts.append(optax.add_decayed_weights(weight_decay))
    if not is_constant_zero(momentum):
        parts.append(kept_momentum(momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return placed(in_gradient_dtypes(optax.chain(*parts)))
