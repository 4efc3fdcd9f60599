r"""Per-example vectors as outer products, from the main pass.

A dense layer applied once to each example (no positions: one location per
example) has, for example n and the estimator's vector k, the gradient
$c_{nk} \tilde a_n^\top$ in its weight's matrix view: $c_{nk}$ the output
cotangent of the vector, $\tilde a_n = [a_n; 1]$ the input (with a bias). Both are
read from the forward and the vector pullback that K-FAC's factors use anyway, so
no pass per example is needed; and the exact diagonal and EKFAC's scales are sums
of squares of these vectors, a few matrix products of the inputs and cotangents
(`structures.Statistics`), where forming the vectors takes N · K · P numbers.

Whether the examples interact is still checked as for the other vectors from the
main pass (`per_example.examples_mismatch`, unless the example axes prove it).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._tracer import MIXED, LayerRecord, PVar, StepVar, VarMap, label_of
from ..blocks._layout import from_matrix
from . import statistics as stats


def _one_location(var, order: tuple[int, ...], d: int, n: int) -> bool:
    """Whether `var`, its axes in `order`, has one location axis, of size `n`."""
    shape = var.aval.shape
    locations = stats.location_count(shape, order, d)
    return locations == 1 and shape[order[0]] == n


def outer_rows_possible(
    records: Sequence[LayerRecord], n: int | None, labels: dict | None
) -> bool:
    """Whether a group's per-example vectors are outer products from the main
    pass: one use of a layer whose inputs are rows (`input_rows`: a dense layer),
    outside kept scans or at one step of one, with one location per example on
    its input and output; with `labels` (`example_axes.proven_labels`), that
    location is the proven example axis."""
    if n is None or len(records) != 1:
        return False
    (r,) = records
    if r.declared:
        # The per-example pass differentiates what computes a declared layer's
        # output; the outer products would trust the declaration (a `y` of
        # `(x @ w) * s + b` declared as `x @ w + b` gave diagonals 13% off).
        return False
    x, y = r.inputs, r.outputs
    if not isinstance(x, PVar) or isinstance(x, StepVar) != isinstance(y, StepVar):
        return False
    rows = jax.eval_shape(lambda v: stats.layer_inputs(r.kind).input_rows(r, v), x.aval)
    if rows is None:
        return False
    if not (
        _one_location(x, r.in_order, r.d_in, n)
        and _one_location(y, r.out_order, r.d_out, n)
    ):
        return False
    if labels is None:
        return True
    ex, ey = label_of(labels, x), label_of(labels, y)
    return ex not in (None, MIXED) and (ex, ey) == (r.in_order[0], r.out_order[0])


def outer_factors(
    record: LayerRecord,
    inputs: stats.LayerInputs,
    cotangents: VarMap,
    with_bias: bool,
    dtype,
    steps_cache: dict,
) -> tuple[Float[Array, "n d_in"], Float[Array, "n k d_out"]]:
    r"""`(ã, c)`: each example's input row `(N, d_in')` (a column of ones last with
    the bias) and its output cotangents of the K vectors `(N, K, d_out)`; the
    example's vectors are $c_{nk} \tilde a_n^\top$ in the weight's matrix view.

    A use at one step of a kept scan is read from the factors of every step,
    computed at once from the scan's stacked values the first time one of its
    steps is asked for and kept in `steps_cache` (a dict shared by the calls for
    one curvature), as `statistics.pooled_factors` does for K-FAC's."""
    if not isinstance(record.inputs, StepVar):
        x = inputs[inputs.layers.index(record)]
        return _factors(record, x, cotangents[record.outputs], with_bias, dtype)
    stacked_in, stacked_out = record.inputs.stacked, record.outputs.stacked  # pyright: ignore[reportAttributeAccessIssue]
    key = ("outer", id(stacked_in), id(stacked_out), with_bias, jnp.dtype(dtype))
    if key not in steps_cache:
        steps_cache[key] = jax.vmap(
            lambda x, ct: _factors(record, x, ct, with_bias, dtype), in_axes=(0, 1)
        )(inputs.values[stacked_in], cotangents[stacked_out])
    a, c = steps_cache[key]
    step = record.outputs.step  # pyright: ignore[reportAttributeAccessIssue]
    return a[step], c[step]


def _factors(record: LayerRecord, x: Array, ct: Array, with_bias: bool, dtype):
    """`outer_factors` from the layer's input `x` and output cotangents `ct`."""
    a = stats.layer_inputs(record.kind).input_rows(record, x)
    assert a is not None  # `outer_rows_possible`
    a = a.astype(dtype)
    if with_bias:
        a = jnp.concatenate([a, jnp.ones((a.shape[0], 1), dtype)], axis=1)
    c = stats.output_matrix(record, ct).astype(dtype)
    return a, jnp.swapaxes(c, 0, 1)


def formed_rows(
    outer: tuple[Array, Array],
    weight_perm: tuple[int, ...],
    shapes: tuple[jax.ShapeDtypeStruct, ...],
) -> tuple[Array, ...]:
    """The vectors of `outer_factors` formed, per operand leaf `(N·K, *shape)`."""
    a, c = outer
    matrices = c[:, :, :, None] * a[:, None, None, :]  # (N, K, d_out, d_in')
    matrices = matrices.reshape((-1,) + matrices.shape[2:])
    return jax.vmap(lambda m: from_matrix(m, weight_perm, shapes))(matrices)
