"""Curvature statistics: K-FAC factors from one forward and a stacked VJP (the
exact per-example vectors are in `per_example.py`).

Each layer kind (a type from the tracer: `DenseKind`, `ConvKind`, ...) has its
input statistics as a type (`AbstractLayerInputs`), found from the kind by
`layer_inputs`, a `functools.singledispatch` on the kind's type (the tracer does not
import this module); `unsupported` says why a layer has none (a scale-and-shift
layer's curvature is kept exact).
"""

import abc
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .. import _compat
from .._config import current_config
from .._tracer import (
    AbstractLayerKind,
    Const,
    ConvKind,
    DenseKind,
    EmbeddingKind,
    LayerRecord,
    LossProgram,
    PVar,
    RegisteredLoss,
    ScaleAndShiftKind,
    Split,
    StepVar,
    VarMap,
    mean_over,
    points,
)
from .patches import conv_patches


def stat_dtype(dtype) -> jnp.dtype:
    """Statistics accumulate in at least float32 (bfloat16 models too)."""
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else jnp.dtype(dtype)


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
    raise NotImplementedError(
        f"No K-FAC input statistics for `{type(kind).__name__}`: register an "
        "`AbstractLayerInputs` for it with `layer_inputs.register`."
    )


def _mean_rows(a: Array, reduce_examples: int | None) -> Array:
    if reduce_examples is None:
        return a
    return a.reshape(reduce_examples, -1, a.shape[-1]).mean(1)


def _joined(second: Array, sums: Array, rows: int, diagonal: bool) -> Array:
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


def _moments_of(a: Array, diagonal: bool, with_bias: bool) -> tuple[Array, int]:
    rows, d = a.shape
    if with_bias and not diagonal and rows <= JOIN_ROWS_PER_COLUMN * (d + 1):
        joined = jnp.concatenate([a, jnp.ones((rows, 1), a.dtype)], axis=1)
        return joined.T @ joined, rows
    second = jnp.sum(a**2, axis=0) if diagonal else a.T @ a
    if with_bias:
        second = _joined(second, jnp.sum(a, axis=0), rows, diagonal)
    return second, rows


class _DenseInputs(AbstractLayerInputs):
    def unsupported(self, record):
        return None

    def moments(self, record, x, reduce_examples, dtype, diagonal, with_bias):
        a = jnp.transpose(x, record.in_order).reshape(-1, record.d_in)
        a = _mean_rows(a.astype(dtype), reduce_examples)
        return _moments_of(a, diagonal, with_bias)

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


def _patches(record: LayerRecord, x: Array) -> Array:
    """The `(locations, d_in)` patch matrix of a conv layer's input."""
    p = functools.partial(_compat.param, record.core.eqn)
    dn = p("dimension_numbers")
    kernel_shape = record.core.eqn.invars[1].aval.shape
    patches = conv_patches(
        x,
        tuple(kernel_shape[i] for i in dn.rhs_spec[2:]),
        p("window_strides"),
        p("padding"),
        p("lhs_dilation"),
        p("rhs_dilation"),
        dn,
    )
    return jnp.moveaxis(patches, dn.out_spec[1], -1).reshape(-1, record.d_in)


class _ConvInputs(AbstractLayerInputs):
    def unsupported(self, record):
        if _compat.param(record.core.eqn, "feature_group_count") != 1:
            return (
                "is a grouped convolution, whose curvature is block-diagonal over "
                "its groups; K-FAC does not support it yet"
            )
        return None

    def moments(self, record, x, reduce_examples, dtype, diagonal, with_bias):
        if _patches_too_large(record):
            second, sums, rows = _chunked_patches(record, x, reduce_examples, diagonal)
            if with_bias:
                second = _joined(second, sums, rows, diagonal)
            return second, rows
        a = _patches(record, x).astype(dtype)
        return _moments_of(_mean_rows(a, reduce_examples), diagonal, with_bias)

    # Its rows are patches of each step's input, formed before any averaging.
    def stacked(self, record):
        return None

    def mean_axes(self, record):
        return None


@layer_inputs.register(ConvKind)
def _(kind: ConvKind) -> AbstractLayerInputs:
    return _ConvInputs()


class _EmbeddingInputs(AbstractLayerInputs):
    # A is diagonal (token frequencies), returned densely; its mean row is the
    # same diagonal, so the bias coupling is that of a dense layer.
    def unsupported(self, record):
        return None

    def moments(self, record, x, reduce_examples, dtype, diagonal, with_bias):
        ids = x[..., record.in_order[0]].reshape(-1)
        counts = jnp.zeros((record.d_in,), dtype).at[ids].add(1)
        second = counts if diagonal else jnp.diag(counts)
        if with_bias:
            second = _joined(second, counts, ids.shape[0], diagonal)
        return second, ids.shape[0]

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


def output_matrix(record: LayerRecord, g: Array) -> Array:
    """`(..., locations, d_out)` from output cotangents with leading stack axes."""
    lead = g.ndim - len(record.out_order)
    perm = tuple(range(lead)) + tuple(lead + i for i in record.out_order)
    g = jnp.transpose(g, perm)
    return g.reshape(g.shape[:lead] + (-1, record.d_out)).astype(stat_dtype(g.dtype))


def kronecker_factors(
    record: LayerRecord,
    x: Array,
    g_stack: Array,
    with_bias: bool,
    dtype,
    *,
    reduce_examples: int | None = None,
    max_factor_dim: int | None = None,
) -> tuple[
    Float[Array, "i i"] | Float[Array, " i"],
    Float[Array, "o o"] | Float[Array, " o"],
    int,
]:
    """A = mean over locations of ã ãᵀ; G = Σ over stacked vectors and locations of
    g gᵀ (the output vectors already carry the loss weights); and the number of
    rows A averages over.

    With `reduce_examples=N` ("reduce" weight sharing), inputs are first averaged
    and output cotangents summed over each example's locations; the example axis is
    the first location axis. A factor larger than `max_factor_dim` is computed as
    its diagonal only, a vector.
    """
    g = _output_factor(record, g_stack, reduce_examples, max_factor_dim)
    a, n = _input_factor(record, x, with_bias, dtype, reduce_examples, max_factor_dim)
    return a, g.astype(dtype), n


def _too_large(d: int, max_factor_dim: int | None) -> bool:
    return max_factor_dim is not None and d > max_factor_dim


def _output_factor(
    record: LayerRecord,
    g_stack: Array,
    reduce_examples: int | None,
    max_factor_dim: int | None,
) -> Array:
    """Σ over stacked vectors and locations of g gᵀ (its diagonal when too large)."""
    gm = output_matrix(record, g_stack)  # (k, locations, d_out)
    if reduce_examples is not None:
        gm = gm.reshape(gm.shape[0], reduce_examples, -1, gm.shape[-1]).sum(2)
    gm = gm.reshape(-1, gm.shape[-1])
    if _too_large(gm.shape[-1], max_factor_dim):
        return jnp.sum(gm**2, axis=0)
    return gm.T @ gm


def _input_factor(
    record: LayerRecord,
    x: Array,
    with_bias: bool,
    dtype,
    reduce_examples: int | None,
    max_factor_dim: int | None,
) -> tuple[Array, int]:
    """A = mean over locations of ã ãᵀ, and the number of rows it averages."""
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)
    diagonal = _too_large(record.d_in + with_bias, max_factor_dim)
    aa, n = layer_inputs(record.kind).moments(
        record,
        x,
        reduce_examples,
        stat_dtype(x.dtype) if inexact else dtype,
        diagonal,
        with_bias,
    )
    return (aa / n).astype(dtype), n


def pooled_factors(
    records: Sequence[LayerRecord],
    inputs: "LayerInputs",
    cotangents: VarMap,
    with_bias: bool,
    dtype,
    *,
    reduce_examples: int | None = None,
    max_factor_dim: int | None = None,
    steps_cache: dict | None = None,
) -> tuple[Array, Array]:
    """K-FAC's A and G of a group whose records are uses of one weight (tied
    weights): the uses' rows pool as extra locations, A = Σᵤ Aᵤ nᵤ / Σᵤ nᵤ and
    G = Σᵤ Gᵤ.

    With `steps_cache` (a dict shared by the calls for one curvature), a use at
    one step of a kept scan is read from the factors of every step of it, computed
    at once (`all_steps_factors`) the first time one of its steps is asked for: a
    stacked layer's per-step blocks then cost one batched product, not one each.

    `inputs` are `layer_outputs_vjp`'s layer inputs and `cotangents` the output
    cotangents it pulls back (stacked vectors first). The uses of a shared weight
    at every step of a kept scan are computed at once, from the scan's stacked
    values, so the work does not grow with the number of steps.
    """
    args = (with_bias, dtype, reduce_examples, max_factor_dim)
    parts = []
    for uses in scan_uses(records):
        first = uses[0]
        stacked = layer_inputs(first.kind).stacked(first) if every_step(uses) else None
        if stacked is not None:
            x = inputs.values[first.inputs.stacked]  # pyright: ignore[reportAttributeAccessIssue]
            g = cotangents[first.outputs.stacked]  # pyright: ignore[reportAttributeAccessIssue]
            parts.append(_steps_factors(stacked, x, g, *args))
            continue
        for r in uses:
            if steps_cache is not None and at_steps(r):
                parts.append(
                    _cached_step_factors(r, inputs, cotangents, args, steps_cache)
                )
                continue
            x, g = inputs[inputs.layers.index(r)], cotangents[r.outputs]
            parts.append(
                kronecker_factors(
                    r,
                    x,
                    g,
                    with_bias,
                    dtype,
                    reduce_examples=reduce_examples,
                    max_factor_dim=max_factor_dim,
                )
            )
    if len(parts) == 1:
        return parts[0][:2]
    total = sum(n for _, _, n in parts)
    a = sum(a_u * (n / total) for a_u, _, n in parts)
    g = sum(g_u for _, g_u, _ in parts)
    return jnp.asarray(a), jnp.asarray(g)


def scan_uses(records: Sequence[LayerRecord]) -> list[list[LayerRecord]]:
    """`records` grouped by the stacked input and output they read (the uses at the
    steps of one kept scan together); a record outside kept scans alone."""
    uses: dict[tuple[int, int], list[LayerRecord]] = {}
    for r in records:
        x, y = r.inputs, r.outputs
        key = (id(x.stacked), id(y.stacked)) if at_steps(r) else (id(r), 0)  # pyright: ignore[reportAttributeAccessIssue]
        uses.setdefault(key, []).append(r)
    return list(uses.values())


def _cached_step_factors(r, inputs, cotangents, args, steps_cache: dict):
    """One step's factors of a layer in a kept scan, from every step's, computed
    once per curvature (`all_steps_factors`) and kept in `steps_cache`."""
    key = (id(r.inputs.stacked), id(r.outputs.stacked), *args[:1], *args[2:])
    if key not in steps_cache:
        x = inputs.values[r.inputs.stacked]
        g = cotangents[r.outputs.stacked]
        steps_cache[key] = all_steps_factors(r, x, g, *args)
    a_all, g_all, n = steps_cache[key]
    return a_all[r.outputs.step], g_all[r.outputs.step], n


def at_steps(record: LayerRecord) -> bool:
    """Whether a record is one step's use inside a kept scan (input and output)."""
    return isinstance(record.inputs, StepVar) and isinstance(record.outputs, StepVar)


def every_step(batch: Sequence[LayerRecord]) -> bool:
    """Whether `batch` are the uses at every step of one scan (more than one)."""
    if len(batch) < 2 or not at_steps(batch[0]):
        return False
    length = batch[0].outputs.stacked.aval.shape[0]  # pyright: ignore[reportAttributeAccessIssue]
    return sorted(r.outputs.step for r in batch) == list(range(length))  # pyright: ignore[reportAttributeAccessIssue]


def _steps_factors(
    record: LayerRecord,
    x: Array,
    g_stack: Array,
    with_bias: bool,
    dtype,
    reduce_examples: int | None,
    max_factor_dim: int | None,
) -> tuple[Array, Array, int]:
    """`kronecker_factors` of the uses at every step of a scan at once: `record`
    reads the stacked input (`AbstractLayerInputs.stacked`), `x` is
    `(steps, *input)` and `g_stack` `(k, steps, *output)`. The step axis is the
    first location axis; "reduce" then averages within each step and example."""
    steps = x.shape[0]
    g_flat = g_stack.reshape((-1,) + g_stack.shape[2:])
    g = _output_factor(record, g_flat, reduce_examples, max_factor_dim)
    reduce = None if reduce_examples is None else steps * reduce_examples
    a, n = _input_factor(record, x, with_bias, dtype, reduce, max_factor_dim)
    return a, g.astype(dtype), n


def all_steps_factors(
    record: LayerRecord,
    x: Array,
    g_stack: Array,
    with_bias: bool,
    dtype,
    reduce_examples: int | None,
    max_factor_dim: int | None,
) -> tuple[Array, Array, int]:
    """`kronecker_factors` of one layer's use at each step of a kept scan, for
    every step at once (a `vmap` over the steps): `x` is `(steps, *input)` and
    `g_stack` `(k, steps, *output)`; A and G come out stacked, `(steps, ...)`."""
    rows = []

    def one(x_t, g_t):
        a, g, n = kronecker_factors(
            record,
            x_t,
            g_t,
            with_bias,
            dtype,
            reduce_examples=reduce_examples,
            max_factor_dim=max_factor_dim,
        )
        rows.append(n)
        return a, g

    a, g = jax.vmap(one, in_axes=(0, 1))(x, g_stack)
    return a, g, rows[0]


def _patch_elements(record: LayerRecord) -> int:
    """Elements of one example's patch matrix (its locations × d_in)."""
    out = record.core.eqn.outvars[0].aval.shape
    batch = out[_compat.param(record.core.eqn, "dimension_numbers").out_spec[0]]
    return math.prod(out) // record.d_out // batch * record.d_in


def _patches_too_large(record: LayerRecord) -> bool:
    """Whether a conv layer's whole patch matrix (all locations × d_in) is over
    the limit."""
    locations = math.prod(record.core.eqn.outvars[0].aval.shape) // record.d_out
    return locations * record.d_in > current_config().max_patch_elements


def _chunked_patches(
    record: LayerRecord,
    x: Array,
    reduce_examples: int | None,
    diagonal: bool = False,
) -> tuple[Array, Array, int]:
    """`(Σ a aᵀ, Σ a, rows)` over a conv layer's patch rows `a`, forming the patch
    matrix for a chunk of examples at a time (a `lax.scan`), so that memory stays
    near `eqfisher.Config.max_patch_elements` however large the batch. With `reduce_examples`, the
    rows are each example's mean patch; with `diagonal`, Σ a aᵀ is its diagonal.

    Examples are the conv's batch axis; the last chunk is padded with zero
    examples, whose patches are zero.
    """
    axis = _compat.param(record.core.eqn, "dimension_numbers").lhs_spec[0]
    x = jnp.moveaxis(x, axis, 0)
    n = x.shape[0]
    limit = current_config().max_patch_elements
    # The fewest chunks within the limit, as equal as can be: padding is then less
    # than one example per chunk.
    chunks = -(-n // max(1, min(n, limit // _patch_elements(record))))
    chunk = -(-n // chunks)
    x = jnp.pad(x, [(0, chunks * chunk - n)] + [(0, 0)] * (x.ndim - 1))
    xs = x.reshape((chunks, chunk) + x.shape[1:])
    d = record.d_in
    dtype = stat_dtype(x.dtype)

    def body(carry, xc):
        a = _patches(record, jnp.moveaxis(xc, 0, axis)).astype(dtype)
        if reduce_examples is not None:
            a = a.reshape(chunk, -1, d).mean(1)
        aa, s = carry
        second = jnp.sum(a**2, axis=0) if diagonal else a.T @ a
        return (aa + second, s + jnp.sum(a, axis=0)), None

    init = (jnp.zeros((d,) if diagonal else (d, d), dtype), jnp.zeros((d,), dtype))
    (aa, s), _ = jax.lax.scan(body, init, xs)
    rows = n if reduce_examples is not None else n * _patch_elements(record) // d
    return aa, s, rows


def example_axis_size(record: LayerRecord) -> int:
    """The size of the layer's first location axis (its example axis)."""
    shape = record.outputs.aval.shape
    first = record.out_order[0]
    return shape[first]


class LayerInputs(Sequence):
    """The inputs of each layer, read from the stacked values on demand."""

    def __init__(self, layers: Sequence[LayerRecord], values: VarMap):
        self.layers = tuple(layers)
        self.values = values

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        a = self.layers[i].inputs
        return a.value if isinstance(a, Const) else self.values[a]


def location_count(shape: Sequence[int], order: Sequence[int], d: int) -> int:
    """How many of `order`'s leading axes are locations: the fewest trailing axes
    whose sizes multiply to `d` are the features."""
    for k in range(1, len(order) + 1):
        if math.prod(shape[i] for i in order[len(order) - k :]) == d:
            return len(order) - k
    return len(order)


def _summed_shape(record: LayerRecord) -> tuple[int, ...]:
    """The shape of a perturbation of the layer's output whose cotangent is each
    example's sum over its locations: every location axis but the first (the
    example axis) of size 1; with the step axis first for a use in a kept scan."""
    shape = record.outputs.aval.shape
    n = location_count(shape, record.out_order, record.d_out)
    rest = set(record.out_order[1:n])
    out = tuple(1 if i in rest else size for i, size in enumerate(shape))
    if isinstance(record.outputs, StepVar):
        return (record.outputs.stacked.aval.shape[0], *out)
    return out


def _agreed(points_of: dict[int, set]) -> dict[int, object]:
    """Each point's one wanted value, for the points whose records all agree on one
    that is not None."""
    return {
        key: next(iter(wanted))
        for key, wanted in points_of.items()
        if len(wanted) == 1 and None not in wanted
    }


def _point(atom: PVar) -> PVar:
    return atom.stacked if isinstance(atom, StepVar) else atom


def per_example_taps(
    layers: Sequence[LayerRecord], per_example: Sequence[LayerRecord]
) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """`(shapes, means)`: for the output points whose every record is in
    `per_example` (statistics from each example's sums of output cotangents and
    mean input rows: K-FAC's "reduce"), the smaller shape to perturb them with
    (`_summed_shape`; float32 and wider outputs, whose cotangent sums lose
    nothing); for the dense inputs whose every record is, the axes to average.
    Keyed by the point's `id`."""
    ok = {id(r) for r in per_example}
    shapes: dict[int, set] = {}
    means: dict[int, set] = {}
    known: dict[tuple, tuple] = {}  # the uses at every step of a scan repeat one
    for r in layers:
        out, point = r.outputs.aval.dtype, _point(r.outputs)
        inputs = _point(r.inputs) if isinstance(r.inputs, PVar) else r.inputs
        key = (id(point), id(inputs), r.kind, r.out_order, r.in_order, r.d_out)
        if id(r) in ok and key not in known:
            summed, read = stat_dtype(out) == out, isinstance(r.inputs, PVar)
            known[key] = (
                _summed_shape(r) if summed else None,
                layer_inputs(r.kind).mean_axes(r) if read else None,
            )
        shape, mean = known[key] if id(r) in ok else (None, None)
        shapes.setdefault(id(point), set()).add(shape)
        if isinstance(r.inputs, PVar):
            means.setdefault(id(inputs), set()).add(mean)
    return _agreed(shapes), _agreed(means)  # pyright: ignore[reportReturnType]


class LayerOutputsVjp(eqx.Module):
    """What `layer_outputs_vjp` gives: one forward of the whole batch and its VJP.

    **Fields:**

    - `loss_inputs`: the registered losses' inputs, one array per loss.
    - `program_outputs`: the outputs of `loss_fn`'s program (with
      `value_and_grad`; else None).
    - `losses`: the registered losses.
    - `layer_inputs`: the layers' inputs, as `LayerInputs`.
    - `vjp`: pulls cotangents of `loss_inputs` back, to `(parameter cotangents,
      layer-output cotangents)`: the latter a `VarMap` over the layers' outputs.
    - `grad_vjp`: pulls cotangents of `program_outputs` back, to a 1-tuple of
      parameter cotangents (with `value_and_grad`; else None).
    """

    loss_inputs: tuple[Array, ...]
    program_outputs: PyTree | None
    losses: tuple[RegisteredLoss, ...]
    layer_inputs: LayerInputs
    vjp: Callable
    grad_vjp: Callable | None


def layer_outputs_vjp(
    processed: LossProgram,
    s: Split,
    layers: Sequence[LayerRecord],
    *,
    value_and_grad: bool,
    per_example: Sequence[LayerRecord] = (),
) -> LayerOutputsVjp:
    """One forward with zero perturbations on the layers' outputs, and its VJP.

    `LayerOutputsVjp.vjp` pulls cotangents of the registered losses' inputs back;
    with `value_and_grad`, the forward also gives the program's outputs and
    `LayerOutputsVjp.grad_vjp` pulls cotangents of them back. Both pull back
    through the one linearisation of one forward: a forward traced twice is merged
    by XLA only outside loops, and a model applied with `lax.scan` would run twice.
    Each puller gives the other's outputs a zero cotangent.

    The records in `per_example` need only each example's sum of output
    cotangents and mean input row (`per_example_taps`): their outputs' cotangents
    come out as those sums (size-1 axes for the other locations) and their inputs
    as those means, computed inside a kept scan, so that neither is stored for
    every location of every step.
    """
    coefs = processed.coefficients(s.inputs)
    shapes, means = per_example_taps(layers, per_example)
    # A scan step's input is read as the scan's stacked `ys` and sliced outside the
    # differentiated forward, so neither grows with the number of steps.
    wanted = points([r.inputs for r in layers if isinstance(r.inputs, PVar)])
    stacked = {id(r.inputs.stacked) for r in layers if isinstance(r.inputs, StepVar)}
    in_scan = {k: v for k, v in means.items() if k in stacked}

    def forward(p_leaves, perturb):
        ev = processed.run(
            list(p_leaves) + s.others + s.batch,
            perturb,
            whole_program=value_and_grad,
            reads=wanted,
            read_means=in_scan,
        )
        tag_inputs = tuple(t[0] for t in ev.tags)
        reads = tuple(
            ev.read(a) if id(a) in stacked else mean_over(ev.read(a), means.get(id(a)))
            for a in wanted
        )
        aux = (processed.losses(ev, coefs), reads)
        return (ev.outputs if value_and_grad else None, tag_inputs), aux

    perturbed = points([r.outputs for r in layers])
    zero = VarMap(
        perturbed,
        [jnp.zeros(shapes.get(id(v), v.aval.shape), v.aval.dtype) for v in perturbed],
    )
    (program_outputs, tags), pull, (losses, values) = jax.vjp(
        forward, s.params, zero, has_aux=True
    )
    no_outputs = jax.tree_util.tree_map(jnp.zeros_like, program_outputs)

    def vjp(tag_cotangents):
        return pull((no_outputs, tag_cotangents))

    def grad_vjp(output_cotangents):
        no_tags = jax.tree_util.tree_map(jnp.zeros_like, tags)
        return pull((output_cotangents, no_tags))[:1]

    return LayerOutputsVjp(
        loss_inputs=tags,
        program_outputs=program_outputs,
        losses=losses,
        layer_inputs=LayerInputs(layers, VarMap(wanted, values)),
        vjp=vjp,
        grad_vjp=grad_vjp if value_and_grad else None,
    )
