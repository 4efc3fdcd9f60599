"""`dataset_curvature`: the curvature of a data set given as batches, each block of
each batch weighted by its share of the set (its examples; K-FAC's input factor,
its rows)."""

import functools
from collections.abc import Callable, Iterable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._config import Config, current_config
from .._refusal import refused_where
from .._tracer import StagedLoss
from ..blocks import AbstractBlock
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
    `BlockDiagonal()`, `Diagonal()`, `KFAC()` (K-FAC averages each factor, so its
    factors are those of the whole set) and `EKFAC()`. The weight of a batch is the
    number of examples its registered loss averages over (the sum of its mask, if
    it has one), so a smaller or padded last batch counts for what it holds; K-FAC's
    input factor, which averages every row the layer sees, masked or not
    (docs/losses.md), is weighted by those rows, so batches of sequences of
    different lengths average as the rows each layer's A averages pool (tokens;
    with "reduce", sequences). Batches of one shape compile once.

    The constant is the same for every batch: a loss summed over its batch
    (`n * mean`) is refused when the batches differ in size, and over batches of
    one size `n` it is the mean times `n`, whose curvature this is (not that of
    the whole set's sum, `N` times the mean).

    `EKFAC()` takes two passes over `batches`, as kronfluence does: K-FAC over all
    of them for the eigenbases, then the scales in those bases, batch by batch
    (`AbstractStructure.fixed_bases`). `batches` must then be iterable twice: a
    list, not a generator.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar` with exactly one registered loss.
    - `model`: a PyTree; the model's inexact arrays are the parameters.
    - `batches`: the data set, an iterable of batches (a list or a generator; a
      list for `EKFAC()`), each a PyTree that `loss_fn` takes. A tuple is
      refused, since a tuple is also one batch `(x, y)`: pass a list.
    - `estimator`, `structure`, `where`, `examples`: as for `eqfisher.curvature`.
    - `key`: a PRNG key, needed by `FisherMC`; batch `i` draws with
      `jax.random.fold_in(key, i)`.

    **Returns:**

    A `Curvature`, as `eqfisher.curvature` returns for one batch.

    **Raises:**

    - `TypeError` when `batches` is a tuple, a dict or an array, or, for
      `EKFAC()`, an iterator (it can be iterated once).
    - `TypeError` when the structure's `fixed_bases()` returns neither None nor
      a pair.
    - `ValueError` when `batches` is empty; when `loss_fn` registers other than
      one loss, or multiplies it by a factor that changes from batch to batch (a
      loss summed over batches of different sizes); when a block of the structure
      cannot be averaged over batches (a block type without
      `averages_batches`, such as `EKFAC()`'s inside `PerLayer`); and the errors
      of `eqfisher.curvature` (a batch that is all padding: leave it out). Under
      `jit`, the check of the factor is Equinox's runtime error.

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
    if isinstance(batches, tuple | Mapping) or eqx.is_array_like(batches):
        raise TypeError(
            f"`{_CALLER}(loss_fn, model, batches, ...)`: `batches` is of type "
            f"{type(batches).__name__}, which is read as one batch; pass the batches "
            "as a list (or any other iterable), or call `eqfisher.curvature` for one "
            "batch."
        )
    passes = structure.fixed_bases()
    average = functools.partial(
        _average, loss_fn, model, batches, estimator, key, where, examples
    )
    if passes is None:
        return average(structure, fixed_bases=False)
    if iter(batches) is batches:
        raise TypeError(
            f"`{_CALLER}(..., structure={structure!r})`: this structure takes two "
            "passes over `batches` (its bases from all of them, then its blocks in "
            f"those bases), and `batches` is a {type(batches).__name__}, which can "
            "be iterated once. Pass a list of batches, or any iterable whose "
            "`iter()` starts again."
        )
    if not (isinstance(passes, tuple) and len(passes) == 2):
        raise TypeError(
            f"`{_CALLER}(..., structure={structure!r})`: "
            f"`{type(structure).__name__}.fixed_bases()` must return None or a "
            f"pair `(first, then)` (see `AbstractStructure.fixed_bases`), got "
            f"{type(passes).__name__}."
        )
    first, then = passes
    bases = average(first, fixed_bases=False)
    return average(then(_precomputed(bases)), fixed_bases=True)


@eqx.filter_jit
def _precomputed(curv: Curvature) -> dict[str, AbstractBlock]:
    """Every block of `curv` by name, with what its solves reuse computed (K-FAC's
    eigendecompositions): once, not in every batch of the second pass."""
    return {name: b.precompute() for name, b in curv.blocks.items()}


def _average(
    loss_fn, model, batches, estimator, key, where, examples, structure, *, fixed_bases
) -> Curvature:
    """One pass over `batches`: their curvatures averaged, each block by its share
    of the set. `fixed_bases`: the blocks are estimated in bases shared by every
    batch, so they average whether or not their type does
    (`AbstractStructure.fixed_bases`)."""
    config = current_config()

    def of_batch(i: int, batch) -> tuple[Curvature, _Counts]:
        batch_key = None if key is None else jax.random.fold_in(key, i)
        return _batch_curvature(
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

    iterator = enumerate(batches)
    head = next(iterator, None)
    if head is None:
        raise ValueError(
            f"`{_CALLER}(loss_fn, model, batches, ...)`: `batches` is empty."
        )
    try:
        total, first = of_batch(*head)
    except Exception as e:
        if isinstance(batches, list) and all(map(eqx.is_array_like, batches)):
            e.add_note(
                f"(`{_CALLER}`: `batches` is a list of {len(batches)} arrays, each "
                "read as one batch. For one batch `(x, y)`, pass `[(x, y)]`.)"
            )
        raise
    if not fixed_bases:
        _check_averages(total)
    total, seen = _first_average(total, first)
    checks = []
    for i, batch in iterator:
        curv, counts = of_batch(i, batch)
        checks.append(_check_factor(counts, first, i))
        total, seen = _weighted_average(total, seen, curv, counts)
    # Checked after the loop: a check on concrete values waits for its batch, which
    # would keep the next batch from being loaded while this one computes.
    for bad, message, got in checks:
        total = refused_where(total, bad, message, got)
    return _per_example(total, seen)


class _Counts(eqx.Module):
    """What a batch's registered loss counts: its `examples` (the sum of its mask)
    and the `coefficient` `loss_fn` returns it times; and, by stored block name,
    the `factor_rows` each K-FAC input factor averages (masked or not)."""

    examples: Array
    coefficient: Array
    factor_rows: dict[str, Array]


@eqx.filter_jit
def _batch_curvature(
    loss_fn, model, batch, estimator, structure, key, where, examples, config: Config
):
    """One batch's curvature and what its loss counts; `config` static, as for
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
    dtype = jnp.result_type(float)
    factor_rows = {}
    curv = builder.curvature(forward, key, factor_rows)[0]
    counts = _Counts(
        examples=jnp.sum(registered.mask, dtype=dtype),
        coefficient=jnp.sum(registered.coefficient).astype(dtype),
        factor_rows={
            k: jnp.asarray(factor_rows[k], dtype)
            for k in curv.stored
            if k in factor_rows
        },
    )
    return curv, counts


def _check_averages(curv: Curvature) -> None:
    """Refuses a curvature with a block whose `ema` does not average its batches."""
    kinds = sorted(
        {type(b).__name__ for b in curv.stored.values() if not b.averages_batches}
    )
    if kinds:
        raise ValueError(
            f"`{_CALLER}(..., structure=...)`: the blocks {kinds} do not average "
            "over batches (`AbstractBlock.averages_batches`), and the structure "
            "gives no fixed bases to estimate them in (`AbstractStructure."
            "fixed_bases`, as `EKFAC()` does). Use `KFAC()`, `EKFAC()` or an exact "
            "structure."
        )


def _check_factor(
    counts: _Counts, first: _Counts, i: int
) -> tuple[Array, str, Callable[[], str]]:
    """`(bad, message, got)` for `refused_where`: that `loss_fn` multiplies its loss
    on batch `i` by the factor it did on the first batch."""
    return (
        jnp.abs(counts.coefficient - first.coefficient)
        > 1e-6 * jnp.abs(first.coefficient),
        f"`{_CALLER}(loss_fn, ...)`: `loss_fn` returns its registered loss times "
        f"another factor on `batches[{i}]` than on `batches[0]`. Batches are "
        "averaged by their examples, which gives the whole set's curvature for "
        "the mean loss times one constant: return the mean (a loss summed over "
        "the batch, `n * mean`, has a factor that changes with the batch size).",
        lambda: (
            f"{float(counts.coefficient):.6g} against {float(first.coefficient):.6g}"
        ),
    )


# Each block is averaged over the batches by its weight in the data set: a block
# linear in the examples by its examples; a K-FAC block's input factor A, which
# averages every row the layer sees, masked or not (docs/losses.md), by those
# rows, and its G by examples, as the mean loss weighs it. A K-FAC block averaged
# by its rows, each batch's scaled by examples over rows (`scale` scales G), and
# the average scaled back by rows over examples, is that: A by rows, G by
# (R_b/R) (N_b/R_b) (R/N) = N_b/N. So K-FAC is the whole set's however the batches
# mask their rows, and whatever rows per example each batch's layers see.


def _scaled(curv: Curvature, factors: dict[str, Array]) -> Curvature:
    for name, c in factors.items():
        curv = curv.map_blocks(lambda b, c=c: b.scale(c), names=[name])
    return curv


def _per_row(curv: Curvature, counts: _Counts) -> Curvature:
    """A batch's curvature with its K-FAC blocks scaled by examples over rows."""
    n = counts.examples
    return _scaled(curv, {k: n / r for k, r in counts.factor_rows.items()})


@eqx.filter_jit
def _first_average(curv: Curvature, counts: _Counts):
    """The first batch's curvature (`_per_row`) and what it weighs: `(examples,
    rows by K-FAC block)`."""
    return _per_row(curv, counts), (counts.examples, counts.factor_rows)


@eqx.filter_jit
def _weighted_average(total: Curvature, seen, curv: Curvature, counts: _Counts):
    """`total` (of `seen`) and the next batch's `curv`, each block by its weight."""
    n, rows = counts.examples, counts.factor_rows
    scaled = _per_row(curv, counts)
    seen_n, seen_rows = seen
    decay = {
        k: seen_rows[k] / (seen_rows[k] + rows[k])
        if k in rows
        else seen_n / (seen_n + n)
        for k in total.stored
    }
    seen = (seen_n + n, {k: seen_rows[k] + rows[k] for k in rows})
    return total.ema(scaled, decay), seen


@eqx.filter_jit
def _per_example(total: Curvature, seen) -> Curvature:
    """The K-FAC blocks scaled back by their rows over the set's examples."""
    n, rows = seen
    return _scaled(total, {k: r / n for k, r in rows.items()})
