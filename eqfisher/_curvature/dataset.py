"""`dataset_curvature`: the curvature of a data set given as batches, each batch's
curvature weighted by its examples."""

from collections.abc import Callable, Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._config import Config, current_config
from .._tracer import StagedLoss
from ..filters import AbstractFilter
from .builder import Builder, check_args
from .estimators import AbstractEstimator
from .examples import AbstractExamples, IndependentExamples
from .operator import Curvature
from .structures import AbstractStructure


_CALLER = "eqfisher.dataset_curvature"


def dataset_curvature(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    key: PRNGKeyArray | None = None,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (an immutable Module)
) -> Curvature:
    """The curvature of `loss_fn` over a data set too large for one batch: the
    batches' curvatures, each weighted by its number of examples.

    For a `loss_fn` that returns the mean of its registered loss (times a constant),
    this is `eqfisher.curvature` of all the batches at once: exactly for `Dense()`,
    `BlockDiagonal()`, `Diagonal()` and `KFAC()` (K-FAC averages each factor, so its
    factors are those of the whole set). The weight of a batch is the number of
    examples its registered loss averages over (the sum of its mask, if it has
    one), so a smaller last batch counts for what it holds. Batches of one shape
    compile once.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar` with exactly one registered loss.
    - `model`: a PyTree; the model's inexact arrays are the parameters.
    - `batches`: the data set, an iterable of batches (a list or a generator), each
      a PyTree that `loss_fn` takes. A tuple is refused, since a tuple is also
      one batch `(x, y)`: pass a list.
    - `estimator`, `structure`, `where`, `examples`: as for `eqfisher.curvature`.
    - `key`: a PRNG key, needed by `FisherMC`; batch `i` draws with
      `jax.random.fold_in(key, i)`.

    **Returns:**

    A `Curvature`, as `eqfisher.curvature` returns for one batch.

    **Raises:**

    - `TypeError` when `batches` is a tuple or an array.
    - `ValueError` when `batches` is empty, when `loss_fn` registers other than
      one loss, or when a block of the structure cannot be averaged over batches
      (`EKFAC()`, whose average would keep the last batch's eigenbases; use
      `KFAC()`), and the errors of `eqfisher.curvature`.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 3, 8, 1, key=jax.random.key(0))
        x, y = jnp.ones((100, 2)), jnp.zeros(100, dtype=int)
        batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)]

        def loss_fn(model, batch):
            x, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model)(x), y)

        curv = ef.dataset_curvature(
            loss_fn, model, batches, estimator=ef.GGN(), structure=ef.KFAC()
        )
        whole = ef.curvature(
            loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.KFAC()
        )
        assert jnp.allclose(curv.as_matrix(), whole.as_matrix(), atol=1e-6)
        ```
    """
    check_args(_CALLER, estimator, structure, key, examples)
    if isinstance(batches, tuple) or eqx.is_array_like(batches):
        raise TypeError(
            f"`{_CALLER}(loss_fn, model, batches, ...)`: `batches` is a "
            f"{type(batches).__name__}, which is read as one batch; pass the batches "
            "as a list (or any other iterable), or call `eqfisher.curvature` for one "
            "batch."
        )
    config = current_config()
    total, seen = None, None
    for i, batch in enumerate(batches):
        batch_key = None if key is None else jax.random.fold_in(key, i)
        curv, count = _batch_curvature(
            loss_fn,
            model,
            batch,
            estimator,
            structure,
            batch_key,
            where,
            examples,
            config,
        )
        if total is None:
            _check_averages(curv)
            total, seen = curv, count
        else:
            total, seen = _weighted_average(total, seen, curv, count)
    if total is None:
        raise ValueError(
            f"`{_CALLER}(loss_fn, model, batches, ...)`: `batches` is empty."
        )
    return total


@eqx.filter_jit
def _batch_curvature(
    loss_fn, model, batch, estimator, structure, key, where, examples, config: Config
):
    """One batch's curvature and its number of examples; `config` static, as for
    `eqfisher.curvature`."""
    del config
    builder = Builder(
        StagedLoss(loss_fn, _CALLER), estimator, structure, where, _CALLER, examples
    )
    forward = builder.linearise(model, batch, value_and_grad=False)
    losses = forward.lin.losses
    if len(losses) != 1:
        raise ValueError(
            f"`{_CALLER}(loss_fn, ...)`: `loss_fn` registers {len(losses)} losses; "
            "batches are weighted by the examples of one. Average the batches' "
            "`eqfisher.curvature` yourself with `Curvature.ema` (docs/choosing.md)."
        )
    (registered,) = losses
    count = jnp.sum(registered.mask, dtype=jnp.result_type(float))
    return builder.curvature(forward, key)[0], count


def _check_averages(curv: Curvature) -> None:
    """Refuses a curvature with a block whose `ema` does not average its batches."""
    kinds = sorted(
        {type(b).__name__ for b in curv.stored.values() if not b.averages_batches}
    )
    if kinds:
        raise ValueError(
            f"`{_CALLER}(..., structure=...)`: the blocks {kinds} cannot be averaged "
            "over batches (an `EKFAC()` block would keep the last batch's "
            "eigenbases). Use `KFAC()`, or an exact structure."
        )


@eqx.filter_jit
def _weighted_average(total: Curvature, seen, curv: Curvature, count):
    """`total` (of `seen` examples) and `curv` (of `count`), weighted by examples."""
    return total.ema(curv, seen / (seen + count)), seen + count
