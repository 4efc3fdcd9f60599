"""What K-FAC's input factor A is for each layer kind: `AbstractLayerInputs`, found
from the kind by `layer_inputs`, a `functools.singledispatch` on the kind's type
(the tracer does not import the curvature code), and the dense and embedding
inputs (a convolution's are in `convolution.py`). `unsupported` says why a layer
has no Kronecker factors (a scale-and-shift layer's curvature is kept exact).
"""

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import cast

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..._tracer import (
    AbstractLayerKind,
    DenseKind,
    EmbeddingKind,
    LayerRecord,
    ScaleAndShiftKind,
)


class AbstractLayerInputs(eqx.Module):
    """What K-FAC's input factor A is for one layer kind."""

    @abc.abstractmethod
    def unsupported(self, record: LayerRecord) -> str | None:
        """Why this layer has no Kronecker factors (a phrase after its name), or
        None when it has them."""

    @abc.abstractmethod
    def moments(
        self,
        record: LayerRecord,
        x: Array,
        reduce_examples: int | None,
        dtype,
        diagonal: bool,
        with_bias: bool,
    ) -> tuple[Float[Array, "d d"] | Float[Array, " d"], int]:
        """`(Σ ã ãᵀ, rows)` over the layer's input rows `a` (each example's mean
        row with `reduce_examples`), `ã = [a; 1]` with `with_bias` and `a`
        without; with `diagonal`, only the diagonal of Σ ã ãᵀ, as a vector."""

    @abc.abstractmethod
    def input_rows(self, record: LayerRecord, x: Array) -> Array | None:
        """The layer's input as rows `(locations, d_in)`, in the order of its
        output's locations (`record.out_order`), each one's outer product with the
        output cotangent at its location being the weight's gradient there (in the
        weight's matrix view); None for a kind whose inputs are not such rows."""

    @abc.abstractmethod
    def stacked(self, record: LayerRecord) -> LayerRecord | None:
        """The record whose `moments` read the inputs of its uses at every step of
        a kept scan at once, from the scan's stacked input `(steps, *input)` with
        the step axis as one more location axis; None when they cannot."""

    @abc.abstractmethod
    def mean_axes(self, record: LayerRecord) -> tuple[int, ...] | None:
        """The axes of the layer's input that each example's mean row averages
        over ("reduce" weight sharing), or None when its rows cannot be averaged
        before they are formed."""


@functools.singledispatch
def layer_inputs(kind: AbstractLayerKind) -> AbstractLayerInputs:
    """The input statistics of a layer kind that has Kronecker factors."""
    raise TypeError(
        f"`layer_inputs(kind)`: no K-FAC input statistics for the layer kind "
        f"`{type(kind).__name__}`. Register an `AbstractLayerInputs` for it with "
        f"`layer_inputs.register({type(kind).__name__})`."
    )


def mean_rows(a: Array, reduce_examples: int | None) -> Array:
    """Each example's mean row with `reduce_examples` (the examples first), else
    the rows."""
    if reduce_examples is None:
        return a
    return a.reshape(reduce_examples, -1, a.shape[-1]).mean(1)


def joined(second: Array, sums: Array, rows: int, diagonal: bool) -> Array:
    """Σ ã ãᵀ (or its diagonal) of `ã = [a; 1]` from Σ a aᵀ (or its diagonal),
    Σ a and the number of rows, in blocks: the rows are not copied."""
    ones = jnp.full((1,), rows, second.dtype)
    if diagonal:
        return jnp.concatenate([second, ones])
    return jnp.block([[second, sums[:, None]], [sums[None, :], ones[None]]])


# Σ ã ãᵀ over few rows takes less time as the product of the rows joined with a
# column of ones than as Σ a aᵀ joined with its bias row and column, a copy of the
# (d + 1)² result: 3.4 against 4.6 ms for 256 rows of 1024, 7.1 against 7.9 ms
# for 2048 rows of 512; over many rows, more: 2.2 against 1.5 ms for 16384 rows
# of 72 (float32, 2 cores; benchmarks/RESULTS.md, "Issue 26, sixteenth session").
JOIN_ROWS_PER_COLUMN = 4


def moments_of(a: Array, diagonal: bool, with_bias: bool) -> tuple[Array, int]:
    """`AbstractLayerInputs.moments` of the rows `a`, formed."""
    rows, d = a.shape
    if with_bias and not diagonal and rows <= JOIN_ROWS_PER_COLUMN * (d + 1):
        ones = jnp.concatenate([a, jnp.ones((rows, 1), a.dtype)], axis=1)
        return ones.T @ ones, rows
    second = jnp.sum(a**2, axis=0) if diagonal else a.T @ a
    if with_bias:
        second = joined(second, jnp.sum(a, axis=0), rows, diagonal)
    return second, rows


class _DenseInputs(AbstractLayerInputs):
    def unsupported(self, record):
        return None

    def moments(self, record, x, reduce_examples, dtype, diagonal, with_bias):
        a = mean_rows(self.input_rows(record, x).astype(dtype), reduce_examples)
        return moments_of(a, diagonal, with_bias)

    def input_rows(self, record, x):
        return jnp.transpose(x, record.in_order).reshape(-1, record.d_in)

    def stacked(self, record):
        order = (0,) + tuple(1 + i for i in record.in_order)
        return dataclasses.replace(record, in_order=order)

    def mean_axes(self, record):
        # Every location axis but the first (the example axis).
        shape = record.inputs.aval.shape
        n = location_count(shape, record.in_order, record.d_in)
        return tuple(sorted(record.in_order[1:n]))


@layer_inputs.register(DenseKind)
def _(kind: DenseKind) -> AbstractLayerInputs:
    return _DenseInputs()


class _EmbeddingInputs(AbstractLayerInputs):
    # A is diagonal (token frequencies), returned densely; its mean row is the
    # same diagonal, so the bias coupling is that of a dense layer.
    def unsupported(self, record):
        return None

    def moments(self, record, x, reduce_examples, dtype, diagonal, with_bias):
        ids = x[..., record.in_order[0]].reshape(-1)
        # The rows the derivative reaches: an id outside the table reaches the
        # nearest row (clamped) unless the gather drops it (`EmbeddingKind.drops`).
        mode = "drop" if cast(EmbeddingKind, record.kind).drops else "clip"
        counts = jnp.zeros((record.d_in,), dtype).at[ids].add(1, mode=mode)
        second = counts if diagonal else jnp.diag(counts)
        if with_bias:
            second = joined(second, counts, ids.shape[0], diagonal)
        return second, ids.shape[0]

    # One-hot rows as wide as the vocabulary: not formed.
    def input_rows(self, record, x):
        return None

    # The row ids `x[..., c]` are read alike under any leading axes; ids are not
    # averaged.
    def stacked(self, record):
        return record

    def mean_axes(self, record):
        return None


@layer_inputs.register(EmbeddingKind)
def _(kind: EmbeddingKind) -> AbstractLayerInputs:
    return _EmbeddingInputs()


@functools.singledispatch
def _unsupported(kind: AbstractLayerKind, record: LayerRecord) -> str | None:
    return layer_inputs(kind).unsupported(record)


# A kind without input statistics: its curvature is kept exact (diagonal blocks).
@_unsupported.register(ScaleAndShiftKind)
def _(kind: ScaleAndShiftKind, record: LayerRecord) -> str:
    return "is a scale-and-shift layer, whose curvature eqfisher keeps exact"


def unsupported(record: LayerRecord) -> str | None:
    """Why a layer has no Kronecker factors (a phrase after its name), or None.
    A kind without input statistics (scale-and-shift) says why itself; for the
    others, their input statistics say (a grouped convolution has none)."""
    return _unsupported(record.kind, record)


def location_count(shape: Sequence[int], order: Sequence[int], d: int) -> int:
    """How many of `order`'s leading axes are locations: the fewest trailing axes
    whose sizes multiply to `d` are the features."""
    for k in range(1, len(order) + 1):
        if math.prod(shape[i] for i in order[len(order) - k :]) == d:
            return len(order) - k
    return len(order)
