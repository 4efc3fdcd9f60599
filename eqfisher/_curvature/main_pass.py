"""The state the builder's phases pass on (`Builder.__call__`), as optimistix's
solvers carry theirs from `init` to `step`: `MainPassRows`, which groups take
their per-example vectors from the main pass (asked of the `examples` option
before it runs), `Linearised`, the grouping and the linearised forward of the
whole batch (which needs no key), and `MainPass`, what that forward and the VJP
of the estimator's vectors gave."""

from collections.abc import Callable

import equinox as eqx
from jaxtyping import Array, PyTree

from .._tracer import LossProgram, RegisteredLoss, Split
from .statistics import LayerInputs, LayerOutputsVjp
from .structures import Group, Needs


class MainPassRows(eqx.Module):
    """The groups whose exact per-example vectors come from the main pass (see
    `per_example.py`: scale-and-shift layers with independent examples; and
    `outer_rows.py`: dense layers applied once to each example).

    **Fields:**

    - `groups`: the scale-and-shift groups; empty when none can.
    - `outer`: the dense groups, whose vectors are outer products.
    - `n_examples`: the number of examples, or None where unknown.
    - `labels`: the labels of `example_axes` when they prove that the examples
      cannot interact; else None (a forward per example then checks it).
    """

    groups: tuple[Group, ...] = ()
    outer: tuple[Group, ...] = ()
    n_examples: int | None = None
    labels: dict | None = None


class Linearised(eqx.Module):
    """What `Builder.linearise` gives `Builder.curvature`: the grouping and one
    forward of the whole batch, linearised.

    **Fields:**

    - `model`, `batch`: the arguments; `split`: the two split into leaves.
    - `processed`: the program of `loss_fn` the forward ran.
    - `selected`: the positions of the selected parameter leaves.
    - `grouping`, `needs`: the structure's groups and what each needs.
    - `main_rows`: the groups whose per-example vectors come from the main pass.
    - `lin`: the forward and its VJP (`statistics.LayerOutputsVjp`).
    - `grads`: the gradient's parameter cotangents (for the gradient; else None).
    """

    model: PyTree
    batch: PyTree
    split: Split
    processed: LossProgram
    selected: list[int]
    grouping: list[Group]
    needs: list[Needs]
    main_rows: MainPassRows
    lin: LayerOutputsVjp
    grads: PyTree | None


class MainPass(eqx.Module):
    """What one forward of the whole batch and its VJP gave the later phases of the
    builder.

    **Fields:**

    - `model`, `batch`: the arguments; `split`: the two split into leaves.
    - `processed`: the `LossProgram` of `loss_fn` the pass ran.
    - `program_outputs`: the program's outputs (for the gradient; else None).
    - `losses`: the registered losses.
    - `vjp`: pulls cotangents of the losses' inputs back, to `(parameter
      cotangents, layer-output cotangents)`.
    - `layer_inputs`: the recorded layers' inputs (`statistics.LayerInputs`).
    - `per_loss`: each loss's output vectors from the estimator, `(k, *inputs)`.
    - `cotangents`: the layers' output cotangents of those vectors, stacked.
    - `grads`: the gradient's parameter cotangents (for the gradient; else None).
    - `main_rows`: the groups whose per-example vectors come from this pass.
    """

    model: PyTree
    batch: PyTree
    split: Split
    processed: LossProgram
    program_outputs: PyTree | None
    losses: tuple[RegisteredLoss, ...]
    vjp: Callable
    layer_inputs: LayerInputs
    per_loss: tuple[Array, ...]
    cotangents: PyTree
    grads: PyTree | None
    main_rows: MainPassRows
