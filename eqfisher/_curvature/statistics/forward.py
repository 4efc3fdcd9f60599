"""One forward of the whole batch with zero perturbations on the layers' outputs,
and its VJP (`layer_outputs_vjp`): the layers' inputs and output cotangents that
the statistics are formed from, read per example where that is all they need
(`per_example_taps`).
"""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from ..._precision import at_least_float32
from ..._tracer import (
    Const,
    LayerRecord,
    LossProgram,
    PVar,
    RegisteredLoss,
    Split,
    StepVar,
    VarMap,
    mean_over,
    points,
)
from .inputs import layer_inputs, location_count


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
            summed, read = at_least_float32(out) == out, isinstance(r.inputs, PVar)
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
