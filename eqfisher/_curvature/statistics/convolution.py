"""A convolution's input statistics: the rows of its input factor A are the
patches of its input (`conv_patches`), formed for a chunk of examples at a time
when the whole patch matrix is over `eqfisher.Config.max_patch_elements`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ... import _compat
from ..._config import current_config
from ..._precision import at_least_float32
from ..._tracer import ConvKind, LayerRecord
from .inputs import (
    AbstractLayerInputs,
    joined,
    layer_inputs,
    mean_rows,
    moments_of,
)
from .patches import conv_patches


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
            second, sums, rows = _chunked_patches(
                record, x, reduce_examples, diagonal, dtype
            )
            if with_bias:
                second = joined(second, sums, rows, diagonal)
            return second, rows
        a = _patches(record, x).astype(dtype)
        return moments_of(mean_rows(a, reduce_examples), diagonal, with_bias)

    # Patches: rows of the kind asked, but a layer applied at one location per
    # example is rare; not formed here.
    def input_rows(self, record, x):
        return None

    # Its rows are patches of each step's input, formed before any averaging.
    def stacked(self, record):
        return None

    def mean_axes(self, record):
        return None


@layer_inputs.register(ConvKind)
def _(kind: ConvKind) -> AbstractLayerInputs:
    return _ConvInputs()


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
    dtype=None,
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
    dtype = at_least_float32(x.dtype) if dtype is None else dtype

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
