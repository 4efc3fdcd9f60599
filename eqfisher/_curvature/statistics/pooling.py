"""The factors of a group of layer uses: the uses of one weight pool (tied
weights), and the uses at the steps of a kept scan are computed at once, from the
scan's stacked values.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._tracer import LayerRecord, StepVar, VarMap
from .factors import input_factor, kronecker_factors, output_factor
from .forward import LayerInputs
from .inputs import layer_inputs


def pooled_factors(
    records: Sequence[LayerRecord],
    inputs: LayerInputs,
    cotangents: VarMap,
    with_bias: bool,
    dtype,
    *,
    reduce_examples: int | None = None,
    max_factor_dim: int | None = None,
    steps_cache: dict | None = None,
) -> tuple[Array, Array, int]:
    """K-FAC's A and G of a group whose records are uses of one weight (tied
    weights), and the number of rows A averages: the uses' rows pool as extra
    locations, A = Σᵤ Aᵤ nᵤ / Σᵤ nᵤ and G = Σᵤ Gᵤ.

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
        return parts[0]
    total = sum(n for _, _, n in parts)
    a = sum(a_u * (n / total) for a_u, _, n in parts)
    g = sum(g_u for _, g_u, _ in parts)
    return jnp.asarray(a), jnp.asarray(g), total


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
    g = output_factor(record, g_flat, reduce_examples, max_factor_dim)
    reduce = None if reduce_examples is None else steps * reduce_examples
    a, n = input_factor(record, x, with_bias, dtype, reduce, max_factor_dim)
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
