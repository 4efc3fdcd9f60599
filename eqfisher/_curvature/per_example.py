"""Exact per-example vectors Uₙₖ = Jₙᵀ V[k, n], for the structures that need them.

Two ways, both checked against the examples computed alone:

- the per-example pass (`per_example_vectors`): `loss_fn` re-traced on one
  example and `vmap`-ped over the batch, forward and backward through the model;
- from the main pass (`shift_rows`), for scale-and-shift layers (LayerNorm,
  positions, a GRU's `bias_n`): an example's gradient is its rows of the layer
  input times the output cotangent, summed over its locations, read from the
  forward and the vector pullback that K-FAC's factors use anyway.

A dense layer applied once to each example takes its vectors from the main pass
too, as outer products (`outer_rows.py`).

The second needs no backward pass per example; what stays per example is a forward
with a tangent (`examples_mismatch`) that checks the examples do not interact, the
same check the per-example pass makes: each example's outputs computed alone, and
their derivative along a fixed parameter direction, against the full batch's (one
more JVP of the full batch, `probe`).
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._tracer import (
    MIXED,
    LayerRecord,
    LossProgram,
    PVar,
    Split,
    StagedLoss,
    VarMap,
    label_of,
    leaf_axes,
    portable,
    split,
)
from ..losses import loss_tag_p
from .statistics import at_steps, every_step, scan_uses


INTERACTION = (
    "examples interact inside `loss_fn`: the registered loss outputs of an example "
    "computed alone differ from that example's outputs in the full batch (in value, "
    "or in their derivative in the parameters), so the "
    "per-example Jacobians that Dense, BlockDiagonal, Diagonal, EKFAC's scales and "
    "K-FAC's diagonal blocks use would be wrong. Likely causes: BatchNorm with batch "
    "statistics (eqx.nn.BatchNorm in training mode, either `mode`); a batch whose "
    "example axis is not the first (time-major `(T, N, F)` data: pass "
    "`examples=eqfisher.IndependentExamples(axis=...)`); randomness shared across "
    "the batch (one dropout key for all examples, or keys split inside `loss_fn`, "
    "which an example run alone splits differently: pass one key per example in "
    "the batch); a "
    "term zero in value but not in derivative, as a straight-through "
    "`m - jax.lax.stop_gradient(m)` of a batch mean `m`. "
    "Fix: pass `examples=eqfisher.InteractingExamples()` for the exact curvature "
    "from full-batch products (cost ∝ batch × outputs), with `axis=` the example "
    "axis among the registered loss's leading axes where it is not the first "
    "(`InteractingExamples(axis=1)` for `(T, N, C)` logits: the default takes "
    "axis 0, time, for the examples, and the empirical Fisher is then wrong), or "
    "run the model in inference mode. (Under `structure=eqfisher.KFAC()` only the exact blocks of "
    "scale-and-shift layers, BatchNorm's and LayerNorm's, need per-example "
    "vectors: K-FAC with a `where=` that leaves them out needs none.)"
)


def example_count(batch, axis, caller: str) -> int | None:
    """The number of examples along `axis` (see `IndependentExamples`), or None
    when the batch's arrays do not share one example axis (`one_example` then
    raises)."""
    s = split(None, batch)
    axes = leaf_axes(axis, batch, caller)
    sizes = {x.shape[a] for x, a in zip(s.batch, axes) if a is not None and a < x.ndim}
    if len(sizes) != 1 or any(
        a is not None and a >= x.ndim for x, a in zip(s.batch, axes)
    ):
        return None
    return sizes.pop()


@dataclasses.dataclass(frozen=True)
class OneExample:
    """`loss_fn` traced on one example, and how its losses line up with the batch's.

    `axes` is the example axis of each batch leaf (None: shared), `n` the number of
    examples, `loss_axes` each registered loss's example axis.
    """

    s: Split
    axes: list
    n: int
    processed: LossProgram
    loss_axes: list[int]

    def run(self, params: Sequence[Array], ex_leaves: Sequence[Array]) -> tuple:
        """The registered losses' inputs for one example, without its example axis."""
        leaves = [
            x if a is None else jnp.expand_dims(x, a)
            for x, a in zip(ex_leaves, self.axes)
        ]
        ev = self.processed.run(list(params) + self.s.others + leaves)
        return tuple(jnp.squeeze(t[0], a) for t, a in zip(ev.tags, self.loss_axes))

    def mismatch(self, full_inputs: Sequence[Array], alone: Sequence[Array]) -> Array:
        """Whether any example's outputs computed alone differ from the batch's, by
        more than the square root of the coarsest float precision among the
        outputs, the parameters and the batch (a float32 layer in a float64 model
        rounds an example alone and the batch apart at 1e-7)."""
        floats = [
            x.dtype
            for x in list(self.s.params) + list(self.s.batch)
            if jnp.issubdtype(x.dtype, jnp.inexact)
        ]
        out = jnp.asarray(False)
        for x, a, y in zip(full_inputs, self.loss_axes, alone):
            x = jnp.moveaxis(x, a, 0)
            eps = max(float(jnp.finfo(d).eps) for d in floats + [x.dtype])
            finite = jnp.isfinite(x)
            scale = jnp.max(jnp.where(finite, jnp.abs(x), 0))
            tol = jnp.sqrt(jnp.asarray(eps, x.dtype)) * (1 + scale)
            # Written so that NaN alone differs (a batch statistic of one example,
            # a standard deviation of 0 divided into 0), where the batch's output
            # is finite.
            out = out | jnp.any(finite & ~(jnp.abs(x - y) <= tol))
        return out


@dataclasses.dataclass(frozen=True)
class Probe:
    """A tangent of some parameter leaves (`direction`) and the registered losses'
    inputs' tangents along it in the full batch (`batch_tangents`), from `probe`.

    Equal values do not prove that examples do not interact: a straight-through
    term `m - stop_gradient(m)` of a batch mean `m` is zero in value, but not in
    derivative. So each example's outputs computed alone are compared with the
    batch's along this tangent too (a fixed pseudo-random one: a coupling is
    missed only for directions of measure zero).
    """

    leaves: tuple[int, ...]
    direction: tuple[Array, ...] | None  # None: compare values only
    batch_tangents: tuple[Array, ...] | None


def probe(
    processed: LossProgram, s: Split, leaves: Sequence[int], derivatives: bool
) -> Probe:
    """The `Probe` of the given parameter leaves: one JVP of the full batch, where
    `derivatives` (a `stop_gradient` of several examples' data,
    `example_axes.stops_mixed_gradients`); else values alone are compared (a JVP
    per example costs about as much to compile as the rest of the pass)."""
    leaves = tuple(leaves)
    if not derivatives:
        return Probe(leaves, None, None)
    keys = jax.random.split(jax.random.key(0), max(len(leaves), 1))
    direction = tuple(
        jax.random.normal(k, s.params[i].shape, s.params[i].dtype)
        for k, i in zip(keys, leaves)
    )
    params = jax.lax.stop_gradient(list(s.params))

    def fn(sel):
        p = list(params)
        for i, leaf in zip(leaves, sel):
            p[i] = leaf
        ev = processed.run(p + s.others + s.batch)
        return tuple(t[0] for t in ev.tags)

    _, batch_tangents = jax.jvp(fn, (tuple(params[i] for i in leaves),), (direction,))
    return Probe(leaves, direction, batch_tangents)


def one_example(
    staged: StagedLoss, model, batch, full_inputs: Sequence[Array], axis
) -> OneExample:
    """Splits the batch into examples along `axis` and traces `loss_fn` on one; each
    loss's example axis is where its one-example outputs have size 1. (A batch
    without examples is refused before, by the builder.)"""
    caller = staged.caller
    s = split(model, batch)
    axes = leaf_axes(axis, batch, caller)
    n = _shared_count(s, batch, axis, axes, caller)
    one_leaves = [
        x if a is None else jax.lax.slice_in_dim(x, 0, 1, axis=a)
        for x, a in zip(s.batch, axes)
    ]
    # Convolutions NCHW / OIHW: their per-example weight cotangents are then
    # right when the examples are sharded (`program.portable`).
    processed = _stage_one(staged, model, batch, one_leaves, axes)
    processed = dataclasses.replace(processed, program=portable(processed.program))
    one_shapes = [
        node.eqn.invars[0].aval.shape
        for node in processed.program.nodes
        if node.eqn.primitive is loss_tag_p
    ]
    loss_axes = [_loss_axis(x.shape, sh, n) for x, sh in zip(full_inputs, one_shapes)]
    if None in loss_axes:
        raise ValueError(
            f"`{caller}`: this structure needs per-example Jacobians, but a "
            "registered loss has no example axis of size "
            f"{n}: its outputs are shaped {[tuple(x.shape) for x in full_inputs]} "
            f"for the batch and {[tuple(sh) for sh in one_shapes]} for one example. "
            "Say where the example axis is with "
            "`examples=eqfisher.IndependentExamples(axis=...)`, or pass "
            "`examples=eqfisher.InteractingExamples()`. (A loss registered once "
            "per example inside `lax.map` or `lax.scan` has no example axis: "
            "register it under `jax.vmap`, or on the batch's outputs.)"
        )
    return OneExample(s, axes, n, processed, [a for a in loss_axes if a is not None])


def _shared_count(s: Split, batch, axis, axes, caller: str) -> int:
    """The number of examples, which every array of `batch` must share."""
    n = example_count(batch, axis, caller)
    if n is not None:
        return n
    sizes = {x.shape[a] for x, a in zip(s.batch, axes) if a is not None and a < x.ndim}
    raise ValueError(
        f"`{caller}`: this structure needs per-example Jacobians, so the arrays "
        "in `batch` must share an example axis of one size; got sizes "
        f"{sorted(sizes)} along the example axes {axes} of arrays shaped "
        f"{[tuple(x.shape) for x in s.batch]}. Say where the example axis is "
        "with `examples=eqfisher.IndependentExamples(axis=...)` (`None` for "
        "arrays every example shares, such as a BatchNorm state), or pass "
        "`examples=eqfisher.InteractingExamples()` (exact, from full-batch "
        "products; also for examples that interact, as through BatchNorm with "
        "batch statistics)."
    )


def _stage_one(staged: StagedLoss, model, batch, one_leaves, axes) -> LossProgram:
    """`loss_fn` traced on the batch cut to its first example; a failure says that
    eqfisher re-ran it, and what `examples=` does."""
    b_dyn, b_static = eqx.partition(batch, eqx.is_array)
    one = eqx.combine(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(b_dyn), one_leaves),
        b_static,
    )
    try:
        return staged.stage(split(model, one), layers=False)  # only run
    except Exception as e:
        raise ValueError(
            f"`{staged.caller}`: this structure needs per-example Jacobians, so "
            "eqfisher re-ran `loss_fn` on one example (every array of `batch` cut "
            f"to size 1 along its example axis: {axes}, shapes "
            f"{[tuple(x.shape) for x in one_leaves]}), and that run failed: "
            f"{type(e).__name__}: {_first_line(e)}. Likely causes: a batch size "
            "written into `loss_fn` (use the shapes of `batch` instead), or "
            "example axes other than those of `examples=` (say where they are "
            "with `examples=eqfisher.IndependentExamples(axis=...)`, as "
            "`jax.vmap`'s `in_axes`). Or pass "
            "`examples=eqfisher.InteractingExamples()`, which never re-runs "
            "`loss_fn` (exact, from full-batch products), or use "
            "`structure=eqfisher.KFAC()`."
        ) from e


def _first_line(e: Exception) -> str:
    lines = str(e).splitlines()
    return lines[0].rstrip(".") if lines else ""


def _loss_axis(
    batch_shape: tuple[int, ...], one_shape: tuple[int, ...], n: int
) -> int | None:
    """The axis where a loss's full-batch shape has `n` and its one-example shape 1."""
    if len(batch_shape) != len(one_shape):
        return None
    diff = [i for i, (a, b) in enumerate(zip(batch_shape, one_shape)) if a != b]
    if not diff:
        if n != 1:
            return None
        # One example: the shapes agree, and the example axis is one of size 1
        # (any one: the vectors are the same), not always the first (a
        # time-major `(T, 1, F)` batch's loss on `(T, 1, C)`).
        return next((i for i, a in enumerate(batch_shape[:-1]) if a == 1), 0)
    if len(diff) == 1 and batch_shape[diff[0]] == n and one_shape[diff[0]] == 1:
        return diff[0]
    return None


def per_example_vectors(
    one: OneExample,
    per_loss: Sequence[Array],
    full_inputs: Sequence[Array],
    prepare: Callable[[list[Array]], tuple[Array, ...]],
    along: Probe,
) -> tuple[list[Array], Array]:
    """Uₙₖ = Jₙᵀ V[k, n] for every example n and vector k, for the leaves of
    `along`, each example computed alone.

    The loss weights come from the full batch (inside `per_loss`, each
    `(k, *leading, out)`); `prepare` turns the vectors, with the example axis moved
    first, into stacked per-example vectors. Returns one `(N·K, *leaf.shape)` array
    per leaf, and whether the examples computed alone differ from the batch's, in
    value or along the probe's tangent (`OneExample.mismatch`).
    """
    s = one.s
    vectors = prepare(
        [jnp.moveaxis(v, 1 + a, 1) for v, a in zip(per_loss, one.loss_axes)]
    )
    selected = list(along.leaves)

    def example(ex_leaves, v):
        def fn(sel):
            p = list(s.params)
            for i, leaf in zip(selected, sel):
                p[i] = leaf
            return one.run(p, ex_leaves)

        if along.direction is None:
            outs, vjp = jax.vjp(fn, [s.params[i] for i in selected])
            return jax.vmap(lambda c: vjp(tuple(c))[0])(v), outs, None
        # One linearisation for the tangent of the probe and the pullbacks.
        outs, jvp = jax.linearize(fn, [s.params[i] for i in selected])
        vjp = jax.linear_transpose(jvp, [s.params[i] for i in selected])
        rows = jax.vmap(lambda c: vjp(tuple(c))[0])(v)
        return rows, outs, jvp(list(along.direction))

    vs = tuple(jnp.moveaxis(v, 1, 0) for v in vectors)  # (N, K, ...)
    out, alone, tangents = jax.vmap(example, in_axes=(list(one.axes), 0))(s.batch, vs)
    mismatch = one.mismatch(full_inputs, alone)
    if along.batch_tangents is not None and tangents is not None:
        mismatch = mismatch | one.mismatch(along.batch_tangents, tangents)
    # Shapes written out, not `-1`: a parameter of size 0 leaves nothing to infer.
    return [x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]) for x in out], mismatch


def examples_mismatch(
    one: OneExample, full_inputs: Sequence[Array], along: Probe
) -> Array:
    """`OneExample.mismatch`, in value and along the probe's tangent, from a
    forward (JVP) per example (no backward)."""
    params = jax.lax.stop_gradient(list(one.s.params))
    if along.direction is None or along.batch_tangents is None:
        alone = jax.vmap(lambda ex: one.run(params, ex), in_axes=(list(one.axes),))(
            one.s.batch
        )
        return one.mismatch(full_inputs, alone)

    def example(ex):
        def fn(sel):
            p = list(params)
            for i, leaf in zip(along.leaves, sel):
                p[i] = leaf
            return one.run(p, ex)

        primals = tuple(params[i] for i in along.leaves)
        return jax.jvp(fn, (primals,), (along.direction,))

    alone, tangents = jax.vmap(example, in_axes=(list(one.axes),))(one.s.batch)
    return one.mismatch(full_inputs, alone) | one.mismatch(
        along.batch_tangents, tangents
    )


# --- scale-and-shift rows from the main pass ------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a scale-and-shift layer's examples are: `example` is the position of
    the example axis among its input's and output's axes transposed to
    (locations..., features...), or None for a batch of one (every location)."""

    example: int | None


def _layout(record: LayerRecord, n: int, labels: dict | None) -> _Layout | None:
    """The layout of `record` for a batch of `n` examples, or None when its rows
    cannot come from the main pass: an input laid out differently from its output,
    or no example axis. With `labels` (`example_axes.proven_labels`) the example
    axis is the labelled one; without, the one location axis of size `n` (the
    examples then need `examples_mismatch`)."""
    x, y = record.inputs, record.outputs
    if not record.kind.elementwise or not isinstance(x, PVar):
        return None
    shape = tuple(y.aval.shape[a] for a in record.out_order)
    if tuple(x.aval.shape[a] for a in record.in_order) != shape:
        return None
    # The features are the shortest trailing axes that hold the layer's d_out.
    locations = next(
        (k for k in range(len(shape), -1, -1) if math.prod(shape[k:]) == record.d_out),
        None,
    )
    if locations is None:
        return None
    if labels is not None:
        ex, ey = label_of(labels, x), label_of(labels, y)
        if ex in (None, MIXED) or ey in (None, MIXED):
            return None
        at = record.in_order.index(ex)
        aligned = at == record.out_order.index(ey) and at < locations
        return _Layout(at) if aligned else None
    if n == 1:
        return _Layout(None)
    at_n = [i for i in range(locations) if shape[i] == n]
    if len(at_n) != 1:
        return None
    return _Layout(at_n[0])


def main_pass_rows_possible(
    records: Sequence[LayerRecord], n: int | None, labels: dict | None
) -> bool:
    """Whether a group's per-example rows can come from the main pass: it is a
    scale-and-shift layer (every use) whose examples lie along one axis."""
    return (
        n is not None
        and bool(records)
        and all(_layout(r, n, labels) is not None for r in records)
    )


def _use_rows(
    record: LayerRecord, layout: _Layout, x: Array, ct: Array, steps: bool
) -> list[Array]:
    """`(N, K, d)` rows of the layer's leaves (scale first) from one use: `x` is the
    input, `ct` the `(K, ...)` output cotangents; with `steps`, both have the step
    axis of a kept scan first (after K), summed as one more location."""
    lead = 1 if steps else 0
    x = jnp.transpose(x, tuple(range(lead)) + tuple(lead + a for a in record.in_order))
    ct = jnp.transpose(
        ct,
        (0,)
        + tuple(range(1, 1 + lead))
        + tuple(1 + lead + a for a in record.out_order),
    )
    d = record.d_out
    if layout.example is None:  # one example: every location is its
        x = x.reshape(1, -1, d)
        ct = ct.reshape(ct.shape[0], 1, -1, d)
    else:  # the example axis first, then every other location, then the features
        x = jnp.moveaxis(x, lead + layout.example, 0)
        x = x.reshape(x.shape[0], -1, d)
        ct = jnp.moveaxis(ct, 1 + lead + layout.example, 1)
        ct = ct.reshape(ct.shape[0], ct.shape[1], -1, d)
    shift = jnp.swapaxes(jnp.sum(ct, axis=2), 0, 1)  # (N, K, d)
    if record.core.name != "mul":
        return [shift]
    scale = jnp.einsum("nld,knld->nkd", x, ct)
    return [scale, shift][: len(record.param_indices)]


def shift_rows(
    records: Sequence[LayerRecord],
    inputs,
    cotangents: VarMap,
    n: int,
    unit_shapes: dict[int, tuple[int, ...]],
    labels: dict | None,
) -> dict[int, Array]:
    """Per parameter number, the `(N·K, *unit shape)` per-example rows of a
    scale-and-shift layer's uses (`main_pass_rows_possible`), from the main pass:
    `inputs` are `layer_outputs_vjp`'s layer inputs, `cotangents` the output
    cotangents of the stacked vectors. Uses of one parameter add up; the uses at
    every step of a kept scan are summed at once from the scan's stacked values."""
    rows: dict[int, Array] = {}
    for uses in scan_uses(records):
        first = uses[0]
        layout = _layout(first, n, labels)
        assert layout is not None
        # `at_steps` and `every_step` say the record's variables are `StepVar`s.
        length = first.outputs.stacked.aval.shape[0] if at_steps(first) else 0  # pyright: ignore[reportAttributeAccessIssue]
        shared = len({r.param_indices for r in uses}) == 1
        if at_steps(first) and shared and len(uses) == length:
            parts = _use_rows(
                first,
                layout,
                inputs.values[first.inputs.stacked],
                cotangents[first.outputs.stacked],  # pyright: ignore[reportAttributeAccessIssue]
                steps=True,
            )
            _add(rows, first.param_indices, parts)
            continue
        if every_step(uses):
            # A stacked layer (its own parameters at each step): every step's rows
            # at once, then each step's taken by its parameters.
            one_step = functools.partial(_use_rows, first, layout, steps=False)
            per_step = jax.vmap(one_step, in_axes=(0, 1))(
                inputs.values[first.inputs.stacked],
                cotangents[first.outputs.stacked],  # pyright: ignore[reportAttributeAccessIssue]
            )
            # Shaped as rows before a step is taken: the builder stacks the steps'
            # rows again (`Builder._run_blocks`), which XLA then reads as the same
            # array, not a copy of each step. The barrier makes the rows one array
            # first: without it jaxlib 0.12's XLA:CPU, from 12 steps on, slices
            # each step's rows out of the vectorised sums (whose sample axis
            # comes first) and copies them into the stack, 2 kernels a step to
            # compile and run.
            per_step = [
                jax.lax.optimization_barrier(p.reshape((length, -1) + unit_shapes[i]))
                for p, i in zip(per_step, first.param_indices)
            ]
            for r in uses:
                _add(rows, r.param_indices, [p[r.outputs.step] for p in per_step])  # pyright: ignore[reportAttributeAccessIssue]
            continue
        for r in uses:
            parts = _use_rows(
                r, layout, inputs[inputs.layers.index(r)], cotangents[r.outputs], False
            )
            _add(rows, r.param_indices, parts)
    return {i: x.reshape((-1,) + unit_shapes[i]) for i, x in rows.items()}


def _add(rows: dict[int, Array], indices: tuple[int, ...], parts: list[Array]) -> None:
    for i, x in zip(indices, parts):
        rows[i] = rows[i] + x if i in rows else x
