"""K-FAC's Kronecker factors of one layer: A from its inputs (`AbstractLayerInputs`)
and G from its output cotangents.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float

from ..._precision import at_least_float32
from ..._tracer import LayerRecord
from .inputs import layer_inputs


def output_matrix(record: LayerRecord, g: Array) -> Array:
    """`(..., locations, d_out)` from output cotangents with leading stack axes."""
    if not (record.d_in and record.d_out):
        raise ValueError(
            f"Layer {record.name} ({', '.join(record.param_paths)}) has "
            f"{record.d_in} inputs and {record.d_out} outputs: its parameters are "
            "empty and have no curvature. Remove the layer from the model, or keep "
            "it out of the curvature with `where=` (or use `eqfisher.Dense()`)."
        )
    lead = g.ndim - len(record.out_order)
    perm = tuple(range(lead)) + tuple(lead + i for i in record.out_order)
    g = jnp.transpose(g, perm)
    return g.reshape(g.shape[:lead] + (-1, record.d_out)).astype(
        at_least_float32(g.dtype)
    )


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
    g = output_factor(record, g_stack, reduce_examples, max_factor_dim)
    a, n = input_factor(record, x, with_bias, dtype, reduce_examples, max_factor_dim)
    return a, g.astype(dtype), n


def _too_large(d: int, max_factor_dim: int | None) -> bool:
    return max_factor_dim is not None and d > max_factor_dim


def output_factor(
    record: LayerRecord,
    g_stack: Array,
    reduce_examples: int | None,
    max_factor_dim: int | None,
) -> Array:
    """Σ over stacked vectors and locations of g gᵀ (its diagonal when too large)."""
    gm = output_matrix(record, g_stack)  # (k, locations, d_out)
    if reduce_examples is not None:
        gm = gm.reshape(gm.shape[0], reduce_examples, -1, gm.shape[-1]).sum(2)
    # Contracted over (k, locations) as two axes: merged into one, a batch sharded
    # along the locations was gathered onto every device (k is the major axis).
    rows = tuple(range(gm.ndim - 1))
    if _too_large(gm.shape[-1], max_factor_dim):
        return jnp.sum(gm**2, axis=rows)
    return jnp.tensordot(gm, gm, axes=(rows, rows))


def input_factor(
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
        # The factor's own dtype where it is wider: float32 inputs of a float64
        # model's layer were averaged in float32 (K-FAC 1e-8 off, Dense exact).
        jnp.promote_types(at_least_float32(x.dtype), dtype) if inexact else dtype,
        diagonal,
        with_bias,
    )
    return (aa / n).astype(dtype), n
