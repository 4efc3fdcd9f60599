"""The one-call K-FAC training step, with amortised statistics."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from .._curvature import (
    AbstractEstimator,
    AbstractExamples,
    AbstractStructure,
    IndependentExamples,
    check_examples,
    value_grad_and_curvature,
    value_grad_then_curvature,
)
from .._refusal import check_flag
from ..filters import AbstractFilter
from ._adaptive_kfac import AdaptiveKFACState
from ._compile import fast_compile_options, filter_jit_with_options
from ._quadratic_model import quadratic_model
from ._state import check_positive_int, find_kfac_state, states_of


def _check_moved(caller: str, grads: PyTree, updates: PyTree) -> None:
    """Refuses updates that are some leaves' gradients themselves, passed through
    the optimiser untouched: added to the parameters, they step up the gradient.
    `optax.masked(kfac, mask)` alone does that to the leaves outside `mask`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    try:
        moved = treedef.flatten_up_to(updates)
    except (ValueError, TypeError):  # another structure: `apply_updates` says so
        return
    through = [
        jax.tree_util.keystr(path)
        for (path, g), u in zip(leaves, moved)
        if u is g and eqx.is_array(g)
    ]
    if through:
        raise ValueError(
            f"`{caller}(loss_fn, optimiser, ...)`: `optimiser` returned the "
            f"gradients of {', '.join(through[:3])}"
            f"{_more(len(through) - 3)} "
            "unchanged as their updates, a step up the gradient: "
            "`optax.masked(kfac, mask)` alone passes the leaves outside `mask` "
            "through. Give those leaves a transformation of their own: "
            "`optax.chain(optax.masked(kfac, mask), optax.masked(optax.adam(1e-3), "
            "rest))` to train them, or `optax.masked(optax.set_to_zero(), rest)` "
            "in its place to freeze them (`rest` the negation of `mask`)."
        )


def _more(count: int) -> str:
    return "" if count <= 0 else f" and {count} more leaf" + ("s" * (count > 1))


def _leading(batch: PyTree, size: int | None) -> PyTree:
    """The first `size` examples of every leaf of `batch` (all when `None`)."""
    if size is None:
        return batch
    sizes = {}  # each leaf's leading size, by its place in `batch`
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        where = f"`batch{jax.tree_util.keystr(path)}`"
        if not eqx.is_array_like(x):
            raise ValueError(
                "`eqfisher.optim.kfac_step(..., curvature_batch_size=...)` takes the "
                f"first examples of every leaf of `batch`, but the leaf at {where} "
                f"is not an array ({type(x).__name__}: the static half of "
                "`eqx.partition`, a function?); keep it out of `batch` (close over "
                "it in `loss_fn`, or combine it into the model)."
            )
        if jnp.ndim(x) == 0:
            raise ValueError(
                "`eqfisher.optim.kfac_step(..., curvature_batch_size=...)` takes the "
                f"first examples of every leaf of `batch`, but the leaf at {where} "
                "is a scalar (a key, a constant, a counter of an `eqx.nn.State`?); "
                "pass it through the model or `loss_fn` instead, or use "
                "`curvature_batch_size=None` (a BatchNorm state carried in the "
                "batch needs it)."
            )
        sizes[where] = jnp.shape(x)[0]
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{where}: {n}" for where, n in sizes.items())
        raise ValueError(
            "`eqfisher.optim.kfac_step(..., curvature_batch_size=...)` takes the "
            "first examples of every leaf of `batch`, but its leaves' leading sizes "
            f"differ ({shown}): a leaf shared by every example (a table, a "
            "schedule) would be cut too. Close over it in `loss_fn` or keep it in "
            "the model instead, or use `curvature_batch_size=None`."
        )
    return jax.tree_util.tree_map(lambda x: x[:size], batch)


def _check_leading(examples: AbstractExamples) -> None:
    """Refuses `curvature_batch_size` for examples along another axis than the
    leading one of every leaf (which is where `_leading` takes them from)."""
    if not examples.batch_leads():
        raise ValueError(
            "`eqfisher.optim.kfac_step(..., curvature_batch_size=...)` takes the "
            "first examples along the leading axis of every leaf of `batch`, but "
            f"`examples={examples!r}` puts them elsewhere; put the example axis "
            "first, or use `curvature_batch_size=None`."
        )


def _check_state_of(optimiser, params: PyTree, opt_state: PyTree, error) -> None:
    """After `optimiser.update` failed: raises a clear error when `opt_state` is
    not a state of `optimiser` (another optimiser's, built before `opt` was
    rebound), which optax reports as a PyTree mismatch deep inside a transform.
    Runs only on failure, so a step that traces costs nothing more."""
    try:
        fresh = jax.eval_shape(optimiser.init, params)
    except Exception:  # noqa: BLE001 (the update's own error is the one to see)
        return
    expected = jax.tree_util.tree_structure(fresh)
    got = jax.tree_util.tree_structure(opt_state)
    if expected != got:
        raise ValueError(
            "`eqfisher.optim.kfac_step`: `opt_state` is not a state of the "
            "`optimiser` this step was built with: its PyTree structure differs "
            "from `optimiser.init(params)`'s (a state made by another optimiser, "
            "say before `opt` was rebound?). Build it with that optimiser's `init`."
        ) from error


def _due(period: int, opt_state: PyTree) -> int | None:
    """`curvature_due=` for statistics at every `period`-th step, by the K-FAC
    state's count (None when they always are); raises when `opt_state` holds no
    K-FAC state."""
    try:
        find_kfac_state(opt_state)
    except ValueError as error:
        raise ValueError(
            "`eqfisher.optim.kfac_step`'s `step(model, opt_state, batch, key)`: "
            "`opt_state` must be the state of the optimiser given to `kfac_step` "
            f"(`opt.init(params)`), got a {type(opt_state).__name__} ({error}) "
            "Are `model` and `opt_state` swapped?"
        ) from None
    return None if period == 1 else period


def _check_step_args(
    caller: str,
    curvature_update_period: int,
    curvature_batch_size: int | None,
    examples: AbstractExamples,
    **flags: bool,
) -> None:
    """`kfac_step`'s checks of its arguments, before anything is traced."""
    check_positive_int("kfac_step", "curvature_update_period", curvature_update_period)
    check_examples(caller, examples)
    if curvature_batch_size is not None:
        check_positive_int("kfac_step", "curvature_batch_size", curvature_batch_size)
        _check_leading(examples)
    for name, flag in flags.items():
        check_flag(caller, name, flag)


def _quadratic_model_if_adaptive(
    loss_fn: Callable, has_aux: bool, surrogate: bool, opt_state, model, batch
) -> dict:
    """`{"quadratic": ...}`, the batch's quadratic model, where `opt_state` holds
    `kfac_adaptive`'s state (its update needs one); else nothing, and nothing
    traced."""
    if not states_of(opt_state, AdaptiveKFACState):
        return {}
    if surrogate:
        raise ValueError(
            "`eqfisher.optim.kfac_step(..., surrogate=True)` with "
            "`eqfisher.optim.kfac_adaptive`: its step lengths and damping come from "
            "the quadratic model of the loss, but the gradient would be the "
            "surrogate's. Use `eqfisher.optim.kfac` for a surrogate."
        )
    loss = (lambda m, b: loss_fn(m, b)[0]) if has_aux else loss_fn
    return {"quadratic": quadratic_model(loss, model, batch)}


def _curvature_functions(
    loss_fn: Callable,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    caller: str,
    has_aux: bool,
    surrogate: bool,
    where: AbstractFilter | PyTree | None,
    examples: AbstractExamples,
) -> tuple[Callable, Callable]:
    """`value_grad_and_curvature` (for a sub-batch's statistics) and
    `value_grad_then_curvature` (the statistics from the step's own forward)."""
    options = {"has_aux": has_aux, "surrogate": surrogate}
    return (
        value_grad_and_curvature(
            loss_fn,
            estimator=estimator,
            structure=structure,
            where=where,
            examples=examples,
            **options,
        ),
        value_grad_then_curvature(
            loss_fn,
            estimator=estimator,
            structure=structure,
            where=where,
            examples=examples,
            caller=caller,
            **options,
        ),
    )


def _value_and_grad(loss_fn: Callable, has_aux: bool, surrogate: bool) -> Callable:
    """`eqx.filter_value_and_grad(loss_fn, has_aux=has_aux)`; with `surrogate`,
    the loss of `loss_fn`'s `(loss, surrogate)` and the surrogate's gradient."""
    if not surrogate:
        return eqx.filter_value_and_grad(loss_fn, has_aux=has_aux)

    def swapped(model, batch):
        loss, gradient_surrogate = loss_fn(model, batch)
        return gradient_surrogate, loss

    surrogate_grad = eqx.filter_value_and_grad(swapped, has_aux=True)

    def value_and_grad(model, batch):
        (_, loss), grads = surrogate_grad(model, batch)
        return loss, grads

    return value_and_grad


def kfac_step(
    loss_fn: Callable,
    optimiser: optax.GradientTransformationExtraArgs,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    curvature_update_period: int = 2,
    curvature_batch_size: int | None = None,
    has_aux: bool = False,
    surrogate: bool = False,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (an immutable Module)
    fast_compile: bool = True,
    donate: bool = False,
) -> Callable:
    r"""One jitted training step: gradient, curvature when due, optimiser update.

    Every step runs one forward of the whole batch and the gradient, as
    `eqfisher.value_grad_and_curvature` does; every `curvature_update_period`-th
    step (counted by the K-FAC state, chosen with `lax.cond` inside jit) also
    pulls the estimator's vectors back through that forward and forms the
    curvature. Only that part is inside the `cond`: the model's forward and
    backward, and the optimiser's update, are compiled once (the update receives
    the curvature as a function, with `curvature_due`, and calls it inside its
    `cond` that folds the estimate in).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, returning a scalar, or `(loss, aux)`
      with `has_aux=True`, or `(loss, gradient_surrogate)` with `surrogate=True`:
      the step follows the surrogate's gradient preconditioned by the registered
      losses' curvature (a natural policy gradient, as ACKTR's), and `value` is
      the loss.
    - `optimiser`: a transformation containing one K-FAC preconditioner (`kfac`,
      `kfac_adaptive`, `kfac_preconditioner` inside an `optax.chain`, ...), built
      with a `like=` from the same `loss_fn`, `estimator` and `structure`. For
      `kfac_adaptive` the step also gives the update the batch's quadratic model
      (`quadratic_model(loss_fn, model, batch)`: a forward of its own and two GGN
      products a step, as the hand-written step of docs/optim.md).
    - `estimator`, `structure`, `has_aux`, `surrogate`, `where`, `examples`: as
      for `eqfisher.value_grad_and_curvature`. With `where=`, the curvature covers the
      parameters it selects, and `optimiser` gets the gradients of all of them:
      compose it so that K-FAC sees only those, e.g.
      `optax.chain(optax.masked(kfac, mask), optax.masked(optax.adam(1e-3), rest))`
      with `mask = eqfisher.filters.optax_mask(model, where)` and `rest` its
      negation (docs/optim.md).
    - `curvature_update_period`: $k \ge 1$: curvature statistics at steps
      $0, k, 2k, \ldots$ (default 2, from the benchmark grid of `kfac`'s grafted
      defaults: fewer steps to a target than $k = 4$ on all five of its problems;
      $k = 1$ takes as few or fewer, but at a statistics pass every step it took
      more seconds on three of them, `benchmarks/RESULTS.md`).
    - `curvature_batch_size`: `None` (the whole batch), or n: the statistics come
      from the first n examples of every leaf of `batch` (leading axis; all of
      them where the batch has at most n), the gradient from the whole batch (one
      extra forward and backward on n examples). It needs the examples along the
      leading axis: refused with `IndependentExamples(axis=...)` other than 0. A
      loss's `mask` must have a positive sum over those n examples, which the
      loss's check refuses otherwise (padding at the front of the batch).
    - `fast_compile`: compile `step` with `eqfisher.optim.fast_compile_options()`
      (default): on the CPU with jaxlib 0.9-0.10, its first call compiles in about
      half the time of XLA's defaults and its steps are 0-10% longer
      (`benchmarks/RESULTS.md`); `False` for XLA's defaults, for runs of many
      thousand steps. On jaxlib 0.12 LLVM -O1 (the XLA compile 6-13% shorter)
      and the module compiled in four parts a core (5% more on digits-std); no
      effect on a GPU, or when `step` is called inside another `jit` (that one's
      options apply).
    - `donate`: `True` donates the arrays of the `model` and `opt_state` passed to
      `step` (`jax.jit(donate_argnums=...)`, as kfac_jax's step always does): XLA
      writes the new ones into their buffers instead of copying the curvature
      averages and cached inverses every step, and the arrays passed in are
      deleted, so only the returned ones may be used again. Default `False`: the
      arguments stay usable (a state reused for several runs, say). No effect
      inside another `jit` (that one's donations apply).

    **Returns:**

    `step(model, opt_state, batch, key=None) -> (model, opt_state, value)`,
    jitted; `value` is the loss, or `(loss, aux)` with `has_aux`;
    `key` is needed by Monte-Carlo estimators. `step.lower(model, opt_state, batch,
    key)` is jax's `Lowered` of that call (`.compile()` to time or inspect the
    compile apart from the run, `.as_text()`), and `step.trace(...)` its `Traced`.

    **Raises:**

    `ValueError` when `curvature_update_period` or `curvature_batch_size` is not a
    positive integer, or `curvature_batch_size` is given with examples along
    another axis than the leading one, or both `has_aux` and `surrogate` are set;
    `TypeError` when `has_aux`, `surrogate`, `fast_compile` or `donate` is not a
    bool, or `examples` is not an examples kind;
    at the first step, when `optimiser`'s state holds no K-FAC state, when
    `optimiser` returns some leaves' gradients unchanged as their updates
    (`optax.masked(kfac, mask)` alone), and the errors of
    `eqfisher.value_grad_and_curvature`.

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
    caller = "eqfisher.optim.kfac_step"
    _check_step_args(
        caller,
        curvature_update_period,
        curvature_batch_size,
        examples,
        has_aux=has_aux,
        surrogate=surrogate,
        fast_compile=fast_compile,
        donate=donate,
    )
    vgc, then = _curvature_functions(
        loss_fn, estimator, structure, caller, has_aux, surrogate, where, examples
    )
    value_and_grad = _value_and_grad(loss_fn, has_aux, surrogate)

    def step(model, opt_state, batch, key=None):
        period = curvature_update_period
        params = eqx.filter(model, eqx.is_inexact_array)
        due = _due(period, opt_state)
        if curvature_batch_size is None:
            value, grads, curvature = then(model, batch, key)
        else:
            value, grads = value_and_grad(model, batch)
            sub = _leading(batch, curvature_batch_size)

            def curvature():
                return vgc(model, sub, key=key)[2]

        # The optimiser calls `curvature` inside its `lax.cond` on `due` (at once
        # when `due` is None: statistics every step).
        # `value=`: for transformations that read the loss, such as
        # `optax.contrib.reduce_on_plateau`.
        quadratic = _quadratic_model_if_adaptive(
            loss_fn, has_aux, surrogate, opt_state, model, batch
        )
        try:
            updates, opt_state = optimiser.update(
                grads,
                opt_state,
                params,
                curvature=curvature,
                curvature_due=due,
                value=value[0] if has_aux else value,
                **quadratic,
            )
        except (ValueError, TypeError) as error:
            _check_state_of(optimiser, params, opt_state, error)
            raise
        _check_moved(caller, grads, updates)
        return eqx.apply_updates(model, updates), opt_state, value

    return filter_jit_with_options(
        step, fast_compile_options() if fast_compile else {}, 2 if donate else 0
    )
