"""The builder shared by `curvature` and `value_grad_and_curvature`: checks the
arguments, selects the parameters, groups them as the structure asks, computes each
group's statistics and assembles the blocks into a `Curvature`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .. import filters
from .._tracer import Traced, proven_labels, split, stops_mixed_gradients
from ..blocks import AbstractBlock
from . import statistics as stats
from .estimators import AbstractEstimator, loss_vectors, stacked_vectors
from .examples import AbstractExamples, IndependentExamples, InteractingExamples
from .operator import Curvature, step_runs
from .per_example import (
    INTERACTION,
    example_count,
    examples_mismatch,
    main_pass_rows_possible,
    one_example,
    per_example_vectors,
    probe,
    shift_rows,
)
from .structures import (
    AbstractStructure,
    Group,
    Needs,
    Statistics,
    candidates,
    check_groups,
)


def check_args(caller: str, estimator, structure, key, examples) -> None:
    if not isinstance(examples, AbstractExamples):
        raise TypeError(
            f"`{caller}(..., examples=...)`: expected eqfisher.IndependentExamples() "
            f"or eqfisher.InteractingExamples(), got {examples!r}."
        )
    if not isinstance(estimator, AbstractEstimator):
        raise TypeError(
            f"`{caller}(..., estimator=...)`: expected an estimator such as "
            f"eqfisher.GGN() or eqfisher.FisherMC(samples=1), got {estimator!r}."
        )
    if not isinstance(structure, AbstractStructure):
        raise TypeError(
            f"`{caller}(..., structure=...)`: expected a structure such as "
            f"eqfisher.KFAC() or eqfisher.Diagonal(), got {structure!r}."
        )
    if estimator.needs_key and key is None:
        raise ValueError(
            f"`{caller}(..., estimator={estimator!r})` needs `key=`: Monte-Carlo "
            "Fisher samples targets."
        )


def _select(model: PyTree, where, caller: str) -> list[int]:
    """The positions of the selected parameter leaves; a `ValueError` when none is."""
    leaves = jax.tree_util.tree_leaves(model)
    is_param = [eqx.is_inexact_array(x) for x in leaves]
    flags = [True] * len(leaves)
    if where is not None and any(is_param):
        try:
            flags = jax.tree_util.tree_leaves(filters.mask(model, where))
        except ValueError as e:
            # Reported below, in the words of this call (and as for no parameters).
            if "selects no parameter" not in str(e):
                raise
            flags = [False] * len(leaves)
    selected = [f for f, p in zip(flags, is_param) if p]
    if not any(selected):
        paths = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_flatten_with_path(model)[0]
            if eqx.is_inexact_array(x)
        ]
        more = f" (and {len(paths) - 5} more)" if len(paths) > 5 else ""
        raise ValueError(
            f"`{caller}`: no parameter selected: the parameters are the "
            "floating-point array leaves of `model` (eqx.filter(model, "
            "eqx.is_inexact_array)) that `where` selects; `model` has "
            f"{', '.join(paths[:5]) or 'none'}{more}"
            + (f", and `where` = {where!r} selects none of them" if paths else "")
            + ". Pass a model with floating-point parameters, or a `where` selecting "
            "some."
        )
    return [i for i, f in enumerate(selected) if f]


INDEPENDENT = IndependentExamples()


def _assemble(params, blocks, grouping, processed, selected) -> Curvature:
    """The `Curvature` of `blocks`: which selected leaves (and scan slices of them)
    each group's block covers, over the parameters' structure."""
    position = {p: j for j, p in enumerate(selected)}
    indices, slices = [], []
    for g in grouping:
        units = [processed.units[i] for i in g.leaves]
        indices.append((g.name, tuple(position[leaf] for leaf, _ in units)))
        slices.append(tuple(index for _, index in units))
    shapes = [
        jax.ShapeDtypeStruct(p.shape, p.dtype) if i in position else None
        for i, p in enumerate(jax.tree_util.tree_leaves(params))
    ]
    structure = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(params), shapes
    )
    if any(any(sl) for sl in slices):
        return Curvature(blocks, tuple(indices), structure, tuple(slices))
    return Curvature(blocks, tuple(indices), structure)


class Builder(eqx.Module):
    """Shared by `curvature` and `value_grad_and_curvature`."""

    traced: Traced = eqx.field(static=True)
    estimator: AbstractEstimator
    structure: AbstractStructure
    where: object = eqx.field(static=True)
    caller: str = eqx.field(static=True)
    examples: AbstractExamples = INDEPENDENT

    def __call__(self, model, batch, key, *, full: bool, cotangent_fn=None):
        selected = _select(model, self.where, self.caller)
        s = split(model, batch)
        processed = self.traced.trace(s)
        grouping, needs = self._grouping(processed, selected, model)
        shifts, n_examples, labels = self._main_pass_rows(
            processed, s, batch, grouping, needs
        )
        records = [r for g, n in zip(grouping, needs) if n.kronecker for r in g.records]
        records += [r for g in shifts for r in g.records]
        outputs, vjp, (losses, inputs), grad_vjp = stats.layer_outputs_vjp(
            processed, s, records, full=full, per_example=_summed(grouping, needs)
        )
        _check_examples(losses, self.caller)
        per_loss = loss_vectors(self.estimator, losses, key)
        vectors = stacked_vectors(per_loss)
        grads = None
        if full:
            # The gradient and the curvature vectors are pulled back separately:
            # batching them would also compute K unused weight gradients, which
            # XLA cannot remove from a batched product.
            (grads,) = grad_vjp(cotangent_fn(outputs[0]))
        _, point_ct = _pull_each(vjp, vectors)
        if self.estimator.splits_positions and any(v.ndim > 3 for v in per_loss):
            shifts = []  # an example's vectors are not its part of the batch's
        rows = self._rows(
            model,
            batch,
            processed,
            losses,
            per_loss,
            vjp,
            grouping,
            needs,
            (shifts, n_examples, labels, s, inputs, point_ct),
        )
        steps_cache = {}

        def statistics(j):
            return self._statistics(
                grouping[j],
                needs[j],
                processed,
                s,
                (inputs, point_ct, steps_cache),
                rows,
                losses[0].inputs.shape[0],
            )

        blocks = self._blocks(grouping, needs, processed, statistics)
        params = eqx.filter(model, eqx.is_inexact_array)
        curv = _assemble(params, blocks, grouping, processed, selected)
        return curv, outputs, grads, s

    def _blocks(self, grouping, needs, processed, statistics) -> dict:
        """Each group's block by name: a stacked layer's steps through one `vmap`
        (`_run_blocks`) where the structure builds them alike, the others one by
        one; `statistics(j)` gathers group j's statistics."""
        blocks = {}
        runs = (
            _step_runs(grouping, needs, processed) if self.structure.steps_alike else []
        )
        for run in runs:
            blocks |= self._run_blocks([grouping[j] for j in run], map(statistics, run))
        done = {j for run in runs for j in run}
        for j, g in enumerate(grouping):
            if j not in done:
                blocks[g.name] = self._block(g, statistics(j))
        return blocks

    def _grouping(self, processed, selected, model):
        """The structure's groups, in parameter order, and what each needs."""
        found = candidates(
            processed,
            selected,
            stats.unsupported,
        )
        try:
            groups = self.structure.groups(found, model)
        except Exception as e:
            e.add_note(f"(from `{self.caller}(..., structure={self.structure!r})`)")
            raise
        grouping = check_groups(self.structure, groups, found, self.caller)
        grouping = sorted(grouping, key=lambda g: min(g.units))
        return grouping, [_needs(self.structure, g, self.caller) for g in grouping]

    def _statistics(self, g, n, processed, s, pulled, rows, batch_size) -> Statistics:
        """One group's `Statistics`: Kronecker factors from the layers' inputs and
        output cotangents `pulled`, per-example vectors from `rows`, as it needs."""
        dtype = stats.stat_dtype(processed.unit_shape(s.params, g.leaves[0])[1])
        a = gg = None
        if n.kronecker:
            reduce = _reduce_examples(self.structure, n, g, batch_size, self.caller)
            # Every step's use of a weight in a kept scan at once, from the
            # scan's stacked values: the work does not grow with the steps.
            inputs, cotangents, steps_cache = pulled
            a, gg = stats.pooled_factors(
                g.records,
                inputs,
                cotangents,
                len(g.leaves) == 2,
                dtype,
                reduce_examples=reduce,
                max_factor_dim=n.max_factor_dim,
                steps_cache=steps_cache,
            )
        return Statistics(
            g.shapes,
            a,
            gg,
            g.records[0].weight_perm if n.kronecker else None,
            tuple(rows[i].astype(dtype) for i in g.leaves) if n.examples else None,
        )

    def _run_blocks(self, groups, statistics) -> dict[str, AbstractBlock]:
        """The blocks of the steps of one stacked layer (`_step_runs`), built at once
        by `jax.vmap` over the steps' statistics (`AbstractStructure.steps_alike`)."""
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *statistics)
        block = jax.vmap(lambda st: self._block(groups[0], st))(stacked)
        return {
            g.name: jax.tree_util.tree_map(lambda x, k=k: x[k], block)
            for k, g in enumerate(groups)
        }

    def _block(self, g, statistics: Statistics) -> AbstractBlock:
        block = self.structure.block(g, statistics)
        if not isinstance(block, AbstractBlock):
            raise TypeError(
                f"`{self.caller}(..., structure={self.structure!r})`: "
                f"`{type(self.structure).__name__}.block` must return an "
                f"`eqfisher.blocks.AbstractBlock`, got {type(block).__name__}."
            )
        return block

    def _main_pass_rows(self, processed, s, batch, grouping, needs):
        """`(groups, n, labels)`: the groups whose per-example rows can come from the
        main pass (see `per_example.py`), scale-and-shift layers with independent
        examples; the number of examples; and the labels of `example_axes` when
        they prove the examples cannot interact (else None: a forward per example
        then checks it)."""
        groups = [g for g, nd in zip(grouping, needs) if nd.examples and g.records]
        if not groups or not isinstance(self.examples, IndependentExamples):
            return [], None, None
        axis = self.examples.axis
        n = example_count(batch, axis, self.caller)
        if n is None:
            return [], None, None
        labels = proven_labels(processed.program, s, batch, axis, self.caller)
        shifts = [g for g in groups if main_pass_rows_possible(g.records, n, labels)]
        return shifts, n, labels

    def _rows(
        self, model, batch, processed, losses, per_loss, vjp, grouping, needs, main
    ):
        """Per parameter number, the exact per-example vectors `(m, *shape)`, for the
        groups that need them: from the main pass where `main` (groups, number of
        examples, labels, split, layer inputs, output cotangents) allows, else
        from a pass per example."""
        shifts, n_examples, labels, s, inputs, point_ct = main
        parts = sorted(
            {i for g, n in zip(grouping, needs) if n.examples for i in g.leaves}
        )
        if not parts:
            return {}
        if isinstance(self.examples, InteractingExamples):
            full_vectors = stacked_vectors(
                [self.estimator.batch_vectors(v, self.examples.axis) for v in per_loss]
            )
            p_ct, _ = jax.vmap(vjp)(full_vectors)
            return _unit_rows(processed, parts, p_ct)
        full_inputs = [loss.inputs for loss in losses]
        shifted = {i for g in shifts for i in g.leaves}
        rest = [i for i in parts if i not in shifted]
        rows, mismatch = {}, None
        if rest or labels is None:
            one = one_example(
                self.traced, model, batch, full_inputs, self.examples.axis
            )
            derivatives = stops_mixed_gradients(
                processed.program, s, batch, self.examples.axis, self.caller
            )
            if rest:
                leaves = sorted({processed.units[i][0] for i in rest})
                vecs, mismatch = per_example_vectors(
                    one,
                    per_loss,
                    full_inputs,
                    lambda v: stacked_vectors(
                        [self.estimator.example_vectors(x) for x in v]
                    ),
                    probe(processed, s, leaves, derivatives),
                )
                rows = _unit_rows(processed, rest, dict(zip(leaves, vecs)))
            else:
                leaves = sorted({processed.units[i][0] for i in parts})
                along = probe(processed, s, leaves, derivatives)
                mismatch = examples_mismatch(one, full_inputs, along)
        if shifts:
            shapes = {i: processed.unit_shape(s.params, i)[0] for i in shifted}
            records = [r for g in shifts for r in g.records]
            rows |= shift_rows(records, inputs, point_ct, n_examples, shapes, labels)
        if mismatch is None:  # proven at trace time (`example_axes`)
            return rows
        message = f"`{self.caller}`: {INTERACTION}"
        return {i: eqx.error_if(x, mismatch, message) for i, x in rows.items()}


def _check_examples(losses, caller: str) -> None:
    """Refuses a batch without examples (a registered loss with no outputs): every
    structure's curvature is a mean over examples."""
    empty = [tuple(x.inputs.shape) for x in losses if 0 in x.inputs.shape[:-1]]
    if empty:
        raise ValueError(
            f"`{caller}`: `batch` holds no examples: the registered loss outputs "
            f"are shaped {empty}, and curvature is a mean over examples. Pass a "
            "batch of at least one."
        )


def _step_runs(grouping, needs, processed) -> list[list[int]]:
    """The groups that are the steps 0, 1, ... of one stacked layer (`step_runs`
    over their units), as positions in `grouping`, all with the same needs and
    operand shapes."""
    units = [[processed.units[i] for i in g.leaves] for g in grouping]
    entries = [(tuple(u for u, _ in us), tuple(k for _, k in us)) for us in units]
    return [
        run
        for run in step_runs(entries)
        if all(
            needs[j] == needs[run[0]] and grouping[j].shapes == grouping[run[0]].shapes
            for j in run
        )
    ]


def _pull_each(vjp, vectors):
    """`jax.vmap(vjp)(vectors)`. One vector (`FisherMC()`'s one sample) is pulled
    back unbatched and given its axis after: XLA:CPU compiles the backward's
    reductions with a unit batch axis far slower (the GPT benchmark's attention
    softmax backward: 153 µs against 16 µs a step)."""
    if jax.tree_util.tree_leaves(vectors)[0].shape[0] != 1:
        return jax.vmap(vjp)(vectors)
    pulled = vjp(jax.tree_util.tree_map(lambda v: v[0], vectors))
    return jax.tree_util.tree_map(lambda v: v[None], pulled)


def _summed(grouping, needs) -> list:
    """The records whose Kronecker factors need only each example's sums of
    output cotangents and mean input rows ("reduce" weight sharing)."""
    return [
        r
        for g, n in zip(grouping, needs)
        if n.kronecker and n.weight_sharing == "reduce"
        for r in g.records
    ]


def _unit_rows(processed, parts, by_leaf) -> dict:
    """Each parameter number's rows, from rows of whole leaves `by_leaf[leaf]`."""
    rows = {}
    for i in parts:
        leaf, index = processed.units[i]
        rows[i] = by_leaf[leaf][(slice(None),) + index]
    return rows


def _needs(structure: AbstractStructure, g: Group, caller: str) -> Needs:
    n = structure.needs(g)
    if not isinstance(n, Needs):
        raise TypeError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            f".needs` must return an `eqfisher.Needs`, got {n!r}."
        )
    if n.kronecker and not g.kronecker:
        raise ValueError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            f".needs` asks for Kronecker factors for `{g.name}`, which has none "
            "(`Group.kronecker` is False): ask for `examples=True` there."
        )
    return n


def _reduce_examples(structure, n: Needs, g: Group, size: int, caller: str):
    if n.weight_sharing != "reduce":
        return None
    first = stats.example_axis_size(g.records[0])
    if first != size:
        raise ValueError(
            f'`{caller}(..., structure={structure!r})`: "reduce" needs the layer\'s '
            f"first location axis to be the example axis, but layer `{g.name}` has "
            f"{first} there and the loss {size} examples."
        )
    return size
