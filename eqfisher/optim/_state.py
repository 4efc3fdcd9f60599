"""The K-FAC optimiser state, its defaults and shared checks."""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from .._curvature import Curvature
from .._precision import at_least_float32
from .._refusal import int_hint, refused_where
from ._damping import FactoredTikhonov


ScalarOrSchedule = float | int | Float[Array, ""] | optax.Schedule
"""A constant (a float or a scalar array) or an optax schedule: a function from the
step count (an integer array, counting updates from 0) to a scalar, such as
`optax.exponential_decay(1e-1, 100, 0.5)` or
`optax.warmup_cosine_decay_schedule(0.0, 0.3, 10, 1000)`. The learning rate is
evaluated at every update; the damping when the cached inverse is refreshed."""

# Defaults chosen from benchmark grids (benchmarks/RESULTS.md); the public
# signatures write these values out, so that the API reference shows them, and
# tests/test_optim.py checks they agree.
#
# `kfac_preconditioner`, the plain K-FAC direction ("The defaults grid",
# benchmarks/kfac_grid.py): no configuration gives a non-finite run at any learning
# rate in 1e-3…1 on its five problems; damping 1e-3 with norm constraint 1e-2 needs
# the fewest steps.
DAMPING = 1e-3
NORM_CONSTRAINT = 1e-2
INVERSE_EVERY = 5
# `kfac`, the direction grafted onto Adam's step lengths, and `kfac_step` ("Issue
# 26, fourth session"): a fresh inverse at each of the first ten estimates,
# statistics every second step and no momentum, no non-finite run. Damping 3e-5
# ("Issue 26, thirteenth session", was 1e-4): over three minibatch seeds, the
# fewest steps of 1e-4, 5e-5, 3e-5, 2e-5 and 1e-5 on the five problems (176
# against 180-197), and fewer than 1e-4 on the 512-wide MLP.
GRAFTED_DAMPING = 3e-5
GRAFTED_INVERSE_EVERY = 10
MOMENTUM = 0.0
CURVATURE_UPDATE_PERIOD = 2
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
      Zeros before the first finite estimate, which always refreshes it: `init`
      factorises nothing.

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

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    curvature_count: Int[Array, ""]
    nonfinite_count: Int[Array, ""]
    skipped_count: Int[Array, ""]
    refresh_count: Int[Array, ""]
    curvature: Curvature
    inverse: Curvature


def value_at(x: ScalarOrSchedule, count: Array) -> Array:
    return jnp.asarray(x(count) if callable(x) else x)


def check_range(
    caller: str, name: str, value: Any, low: float, high: float | None, closed: bool
) -> None:
    if not is_constant(value):
        return
    if not _is_real_scalar(value):
        off = value is None and name in ("momentum", "weight_decay")
        raise TypeError(
            f"`eqfisher.optim.{caller}(..., {name}=...)`: a real number (or, where "
            "taken, a schedule: a function of the step count), got "
            f"{value!r}{' (0 switches it off)' if off else ''}."
        )
    v = float(value)
    ok = (v >= low if closed else v > low) and (high is None or v < high)
    if not ok or not math.isfinite(v):
        if high is None:
            bounds = f">= {low}" if closed else f"> {low}"
        else:
            bounds = f"in [{low}, {high})" if closed else f"in ({low}, {high})"
        half = jnp.result_type(value) in (jnp.float16, jnp.bfloat16)
        raise ValueError(
            f"`eqfisher.optim.{caller}(..., {name}=...)`: `{name}` must be "
            f"finite and {bounds}, got {value!r}."
            + (
                " A half-precision value: `optax.inject_hyperparams` casts "
                "hyperparameters to the parameters' dtype, where a small damping "
                "rounds to 0; pass `hyperparam_dtype=jnp.float32` to it."
                if half
                else ""
            )
        )


def checked_in_range(
    caller: str, name: str, value: Any, low: float, high: float | None
) -> Any:
    """`value`, checked to be finite and in `[low, high)`: a constant now
    (`check_range`), a traced one (set in `optax.inject_hyperparams`'s state) at
    every update, by Equinox's runtime error."""
    if is_constant(value):
        check_range(caller, name, value, low, high, True)
        return value
    value = jnp.asarray(value)
    bad = ~(jnp.isfinite(value) & (value >= low))
    if high is not None:
        bad = bad | (value >= high)
    bounds = f">= {low}" if high is None else f"in [{low}, {high})"
    message = (
        f"`eqfisher.optim.{caller}(..., {name}=...)`: `{name}` must be finite and "
        f"{bounds} at every update (a value set in `optax.inject_hyperparams`'s "
        "state?)."
    )
    return refused_where(value, bad, message, lambda: repr(value.item()))


def _is_real_scalar(value: Any) -> bool:
    """Whether `value` is one real number: a Python or NumPy scalar, or an array of
    no axes (a string such as `"1e-2"` would pass `float`, a vector fail in it)."""
    if value is None or isinstance(value, (str, bytes, bool)):
        return False
    try:
        dtype = jnp.result_type(value)
    except TypeError:
        return False
    return jnp.ndim(value) == 0 and (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    )


def is_constant_zero(value: Any) -> bool:
    """Whether an optional term's coefficient is a Python 0, so that its
    transformation is left out. An array (one swept under `vmap`, or
    `optax.inject_hyperparams`'s) always gets it: the state's structure must not
    depend on its value."""
    return isinstance(value, (int, float)) and value == 0


def is_constant(value: Any) -> bool:
    """Whether a hyperparameter is a constant known when the optimiser is built
    (checked then, by `check_range`), not a schedule or a traced array (checked at
    each update, by `checked_at`)."""
    return not callable(value) and not isinstance(value, jax.core.Tracer)


def check_positive_int(caller: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"`eqfisher.optim.{caller}(..., {name}=...)`: must be a positive int, "
            f"got {value!r}{int_hint(value)}."
        )


def check_like(caller: str, like: Any) -> None:
    if not isinstance(like, Curvature):
        raise TypeError(
            f"`eqfisher.optim.{caller}(..., like=...)` needs a `Curvature` of the "
            "shape the updates will see, e.g. `eqfisher.optim.curvature_like(vgc, "
            f"model, batch, key=key)`; got {type(like).__name__}."
        )


def check_preconditioner_args(
    caller: str,
    like: Any,
    damping_name: str,
    damping: Any,
    decay: Any,
    inverse_every: Any,
) -> None:
    """The arguments every K-FAC preconditioner takes: a `like=` curvature, a
    positive damping, a decay in [0, 1) and a positive inverse period."""
    check_like(caller, like)
    check_range(caller, damping_name, damping, 0.0, None, False)
    check_range(caller, "decay", decay, 0.0, 1.0, True)
    if isinstance(inverse_every, jax.Array) and jnp.issubdtype(
        inverse_every.dtype, jnp.integer
    ):
        # An integer array, as `optax.inject_hyperparams` passes every numeric
        # argument: the refresh rule computes with it; a concrete one is checked.
        if isinstance(inverse_every, jax.core.Tracer):
            return
        inverse_every = int(inverse_every)
    check_positive_int(caller, "inverse_every", inverse_every)


def checked_at(
    caller: str, name: str, value: Array, carrier: PyTree, *, allow_zero: bool
) -> PyTree:
    """`carrier`, after checking that the value `value` of the `name=` schedule (or
    constant) is finite and positive (non-negative with `allow_zero`): a concrete
    value that is not raises `ValueError`, a traced one Equinox's runtime error
    (`eqx.error_if`, attached to `carrier`)."""
    bound = ">= 0" if allow_zero else "> 0"
    message = (
        f"`eqfisher.optim.{caller}(..., {name}=...)`: `{name}` must be finite and "
        f"{bound} at every update; a schedule returned a value that is not, or one "
        "was set in `optax.inject_hyperparams`'s state. Fix or clip the schedule "
        "(e.g. `lambda n: jnp.maximum(schedule(n), 1e-8)`), or the value set."
    )
    value = jnp.asarray(value)
    ok = jnp.isfinite(value) & ((value >= 0) if allow_zero else (value > 0))
    return refused_where(carrier, ~ok, message, lambda: repr(value.item()))


def require_estimate(
    caller: str, updates: PyTree, state: "KFACState", *, unless: Array | None = None
) -> PyTree:
    """`updates`, after checking that a curvature estimate has been received: an
    update without `curvature=` (or with `curvature_due` False) before any has
    nothing to precondition with. `unless`: a traced bool that waives the check
    (this update brings an estimate)."""
    message = (
        f"`eqfisher.optim.{caller}(...).update(grads, state, params)`: no "
        "curvature estimate given (no `curvature=`, or `curvature_due` False), and "
        "none received before, so there is nothing to "
        "precondition with (the update would be zero). Pass "
        "`update(grads, state, params, curvature=curv)` with `curv` from "
        "`eqfisher.value_grad_and_curvature` at the first update (and whenever "
        "statistics are due), or train with `eqfisher.optim.kfac_step`."
    )
    none = state.curvature_count + state.nonfinite_count == 0
    if unless is not None:
        none = none & ~unless
    return refused_where(updates, none, message)


def float_type(leaves: Sequence[Array]) -> type:
    """The float type in which to reduce `leaves` together: float64 when one of
    them is 64-bit, else float32. Leaves of different widths (bfloat16 beside
    float32) have no implicit common type under strict dtype promotion, and a cast
    keeps NaN and inf."""
    widest = max(jnp.dtype(x.dtype).itemsize for x in leaves)
    return jnp.float64 if widest >= 8 else jnp.float32


def widened(tree: PyTree) -> PyTree:
    """`tree` with its float16 and bfloat16 leaves cast to float32, the rest as
    they are. (Adam's second moment of a float16 gradient underflows to zero, and
    its `eps` of 1e-8 with it.)"""

    def widen(x):
        if eqx.is_inexact_array(x):
            return x.astype(at_least_float32(x.dtype))
        return x

    return jax.tree_util.tree_map(widen, tree)


# `all_finite` reduces a leaf of more elements than this by itself: the
# concatenation would copy it (a 1,025-square factor: 4 MB, about 1 ms a check),
# where a kernel more costs about 5 ms of compile time once (the 12-block GPT's
# stacked factors, 12 x 129², stay joined).
_ALL_FINITE_MAX_JOINED = 2**18


def all_finite(tree: PyTree) -> Array:
    """Whether every element of every leaf is finite: one reduction over the leaves
    concatenated, which XLA fuses into one kernel (a reduction per leaf is a
    kernel each, about 7 ms of compile time apiece); a leaf of more than 2**18
    elements is summed by itself, times 0, not copied."""
    leaves = [jnp.ravel(x) for x in jax.tree_util.tree_leaves(tree)]
    large = [x for x in leaves if x.size > _ALL_FINITE_MAX_JOINED]
    small = [x for x in leaves if x.size <= _ALL_FINITE_MAX_JOINED]
    # x·0 is 0 where x is finite and NaN elsewhere, and a sum vectorises where a
    # reduction of booleans does not (135 against 326 us for 1,025² elements).
    checks = [jnp.isfinite(jnp.sum(x * 0)) for x in large]
    if small:
        dtype = float_type(small)
        joined = jnp.concatenate([x.astype(dtype) for x in small])
        checks.append(jnp.all(jnp.isfinite(joined)))
    return functools.reduce(jnp.logical_and, checks) if checks else jnp.asarray(True)


# The row sums of `sum_squares` stay at most about this many (plus one per leaf):
# its masked reduction over them is leaves x rows elements.
_SUM_SQUARES_ROWS = 2048
# `sum_squares` packs more than this many leaves, of at most this many elements
# in all; it sums each leaf by itself otherwise. Packed, the six leaves of the
# digits MLP compile in 20 against 46 ms (two calls: 41 against 92 ms, 155 against
# 113 us a call alone), and a K-FAC step's XLA compile is 0.04-0.06 s shorter
# (benchmarks/RESULTS.md, "Issue 26, nineteenth session"); for many elements,
# packing copies every element once more (and would gather sharded leaves).
_SUM_SQUARES_MIN_PACKED = 1
_SUM_SQUARES_MAX_PACKED = 2**20


def sum_squares(leaves: Sequence[Array]) -> Array:
    """Each leaf's sum of squares, as one vector (in `float_type(leaves)`), in three
    kernels for all the leaves together: each leaf zero-padded to whole rows of
    one width, the rows stacked and summed, then each leaf's rows added by a
    masked reduction. A sum per leaf is one to two kernels each on the CPU
    (XLA splits a long sum in two): 5-7 ms of compile time apiece. One leaf, or
    more than 2**20 elements in all, are summed one by one."""
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    dtype = float_type(leaves)
    total = sum(math.prod(jnp.shape(x)) for x in leaves)
    if len(leaves) <= _SUM_SQUARES_MIN_PACKED or total > _SUM_SQUARES_MAX_PACKED:
        return jnp.stack(
            [jnp.sum(jnp.square(jnp.ravel(x).astype(dtype))) for x in leaves]
        )
    # A power of two of at least 32 (XLA's CPU sums up to 32 elements in one pass).
    width = max(32, 1 << max(0, math.ceil(total / _SUM_SQUARES_ROWS) - 1).bit_length())
    pieces, starts = [], [0]
    for x in leaves:
        flat = jnp.ravel(x).astype(dtype)
        rows = -(-flat.size // width)
        pieces.append(jnp.pad(flat, (0, rows * width - flat.size)))
        starts.append(starts[-1] + rows)
    rows = jnp.sum(jnp.square(jnp.concatenate(pieces).reshape(-1, width)), axis=1)
    row = jax.lax.broadcasted_iota(jnp.int32, (len(leaves), starts[-1]), 1)
    lo = jnp.asarray(starts[:-1], jnp.int32)[:, None]
    hi = jnp.asarray(starts[1:], jnp.int32)[:, None]
    return jnp.sum(jnp.where((row >= lo) & (row < hi), rows, 0), axis=1)


def where_tree(cond: Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(cond, a, b), new, old)


def choose_tree(cond: Array, new: PyTree, old: PyTree) -> PyTree:
    """`new` where `cond` else `old`, for whole trees: a `lax.cond` that passes one
    of them through (no kernel per leaf, as `where_tree`'s selects are)."""
    return branch(cond, lambda: new, lambda: old)


def branch(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """`lax.cond(pred, true_fun, false_fun, *operands)` inside a trace; where `pred`
    is concrete (an update called outside `jit`, as in the README's loop), the
    branch itself. An eager `lax.cond` of new closures compiled both branches
    again at every call (0.2-0.7 s an update)."""
    if isinstance(pred, jax.core.Tracer):
        return jax.lax.cond(pred, true_fun, false_fun, *operands)
    return true_fun(*operands) if bool(pred) else false_fun(*operands)


def _placement(params: PyTree) -> jax.sharding.Sharding | None:
    """Where `init` puts the state: replicated over the mesh of `params`, where they
    are concrete arrays of this process placed with `NamedSharding`s of one mesh of
    several devices (docs/scale.md's recipe); on their device, where they are all
    on one device other than the default one; else None (the default device).
    (Across processes, `init` is jitted: docs/scale.md.)"""
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or not all(
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.is_fully_addressable
        for x in leaves
    ):
        return None
    shardings = [x.sharding for x in leaves]
    devices = {d for s in shardings for d in s.device_set}
    if len(devices) == 1:
        (device,) = devices
        if device == jax.devices()[0]:
            return None
        return jax.sharding.SingleDeviceSharding(device)
    named = [s for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
    meshes = {s.mesh for s in named}
    if len(named) != len(shardings) or len(meshes) != 1:
        return None
    return jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec())


def placed(
    inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """`inner`, its `init` putting every state array left elsewhere where the
    parameters are (`_placement`: optax's counters, say, and K-FAC's zeros are made
    on the default device): a jitted step then finds its state where its first
    call leaves it, and does not compile again at its second call."""

    def init(params):
        state = inner.init(params)
        target = _placement(params)
        if target is None:
            return state
        devices = target.device_set
        return jax.tree_util.tree_map(
            lambda x: (
                jax.device_put(x, target)
                if isinstance(x, jax.Array) and x.sharding.device_set != devices
                else x
            ),
            state,
        )

    return optax.GradientTransformationExtraArgs(init, inner.update)


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


def states_of(state: PyTree, kind: type) -> list:
    """The nodes of type `kind` inside an optimiser state (an `optax.chain`'s,
    say)."""
    return [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(s, kind)
    ]


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
    found = states_of(state, KFACState)
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


def _fields(block: Any) -> list[str]:
    """A block's arrays and their shapes, e.g. `['a (4, 4)', 'g (5, 5)']`."""
    leaves = jax.tree_util.tree_flatten_with_path(block)[0]
    return [
        f"{jax.tree_util.keystr(path).lstrip('.')} {tuple(jnp.shape(leaf))}"
        for path, leaf in leaves
    ]


def like_mismatch(like: Any, curvature: Any) -> str:
    """What differs between the optimiser's `like` (as averaged in its state) and a
    received `curvature`, for the error message: the first block, in the model's
    order, that is missing, extra, or of another type or factor shapes (both
    shown); "" where no block differs."""
    if not (isinstance(like, Curvature) and isinstance(curvature, Curvature)):
        return ""
    want, got = like.blocks, curvature.blocks
    for name in [*want, *(n for n in got if n not in want)]:
        if name not in got:
            return (
                f"block `{name}` of `like` is missing from `curvature=` (whose "
                f"blocks are {list(got)})"
            )
        if name not in want:
            return (
                f"`curvature=` has a block `{name}` that `like` has not (`like`'s "
                f"blocks are {list(want)})"
            )
        a, b = want[name], got[name]
        if type(a) is not type(b):
            return (
                f"block `{name}` is a {type(a).__name__} in `like` but a "
                f"{type(b).__name__} in `curvature=`"
            )
        if _fields(a) != _fields(b):
            return (
                f"block `{name}` ({type(a).__name__}) has "
                f"{', '.join(_fields(a))} in `like` but {', '.join(_fields(b))} "
                "in `curvature=`"
            )
    want_shapes = [x.shape for x in jax.tree_util.tree_leaves(like.structure)]
    got_shapes = [x.shape for x in jax.tree_util.tree_leaves(curvature.structure)]
    if want_shapes != got_shapes:
        return (
            f"the parameters covered differ: leaf shapes {want_shapes} in `like`, "
            f"{got_shapes} in `curvature=`"
        )
    return dtype_mismatch(like, curvature, "`like`")


def dtype_mismatch(ours: Any, curvature: Any, what: str) -> str:
    """Where the floating-point dtypes of `ours` (the optimiser's `like`, or its
    state's average) and a received `curvature` differ, for the error message;
    "" where they agree."""
    pairs = zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(curvature))
    for a, b in pairs:
        if jnp.result_type(a) != jnp.result_type(b):
            return (
                f"the dtypes differ: {jnp.result_type(a)} in {what}, "
                f"{jnp.result_type(b)} in `curvature=` (build `like` and the "
                "state from the model in the dtype it trains in, and do not cast "
                "the state)"
            )
    return ""
