"""The builder shared by `curvature` and `value_grad_and_curvature`: checks the
arguments, selects the parameters, groups them as the structure asks, computes each
group's statistics and assembles the blocks into a `Curvature`.

`Builder.__call__` runs it as phases: the grouping (`_grouping`) and one forward
of the whole batch with its linearisation (`linearise`, kept in a `Linearised`),
then (`curvature`) the main pass (`_main_pass`: the VJP of the estimator's
vectors, whose products it keeps in a `MainPass`), the per-example vectors (`_rows`, asked of the `examples` option),
the blocks (`_blocks`, from each group's `_statistics`) and the `Curvature`
(`_assemble`).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import PyTree

from .. import filters
from .._precision import at_least_float32
from .._refusal import check_key, refused_where
from .._tracer import StagedLoss, label_of, proven_labels, split
from ..blocks import AbstractBlock
from . import statistics as stats
from .estimators import AbstractEstimator, loss_vectors, stacked_vectors
from .examples import AbstractExamples, IndependentExamples
from .fits import check_fits
from .main_pass import Linearised, MainPass, MainPassRows
from .operator import Curvature, step_runs
from .outer_rows import formed_rows, outer_factors
from .per_example import INTERACTION
from .structures import (
    AbstractStructure,
    Group,
    Needs,
    Statistics,
    candidates,
    check_groups,
)


def check_examples(caller: str, examples) -> None:
    if not isinstance(examples, AbstractExamples):
        raise TypeError(
            f"`{caller}(..., examples=...)`: expected eqfisher.IndependentExamples() "
            f"or eqfisher.InteractingExamples(), got {examples!r}."
        )


def check_args(caller: str, estimator, structure, key, examples) -> None:
    check_examples(caller, examples)
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
            f"`{caller}(..., estimator={estimator!r})` needs `key=`: "
            f"`{type(estimator).__name__}.needs_key` is True (Monte-Carlo Fisher "
            "samples targets)."
        )
    if key is not None:
        check_key(caller, key)


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
            + (
                f" (`model` is a {type(model).__name__}: is it `loss_fn`? The "
                "arguments are `(loss_fn, model, batch)`, `loss_fn` first.)"
                if callable(model) and not isinstance(model, eqx.Module)
                else ""
            )
        )
    return [i for i, f in enumerate(selected) if f]


INDEPENDENT = IndependentExamples()


def _assemble(params, blocks, grouping, processed, selected) -> Curvature:
    """The `Curvature` of `blocks`: which selected leaves (and scan slices of them)
    each group's block covers, over the parameters' structure."""
    position = {p: j for j, p in enumerate(selected)}
    indices, slices = [], []
    for g in grouping:
        units = [processed.units[i] for i in g.param_indices]
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

    staged: StagedLoss = eqx.field(static=True)
    estimator: AbstractEstimator
    structure: AbstractStructure
    where: object = eqx.field(static=True)
    caller: str = eqx.field(static=True)
    examples: AbstractExamples = INDEPENDENT

    def __call__(
        self, model, batch, key, *, value_and_grad: bool, cotangent_fn=None
    ) -> tuple[Curvature, MainPass]:
        """The curvature, and the main pass's `MainPass` (with `value_and_grad`, its
        `program_outputs` and `grads` for the value and the gradient, the
        gradient's cotangents from `cotangent_fn(program_outputs)`)."""
        forward = self.linearise(
            model, batch, value_and_grad=value_and_grad, cotangent_fn=cotangent_fn
        )
        return self.curvature(forward, key)

    def linearise(
        self, model, batch, *, value_and_grad: bool, cotangent_fn=None
    ) -> Linearised:
        """The first phases: the grouping, and one forward of the whole batch with
        its linearisation (and, with `value_and_grad`, the gradient). Needs no
        `key`: `curvature` can run later, e.g. inside a `lax.cond` whose
        operands are this forward's residuals."""
        selected = _select(model, self.where, self.caller)
        s = split(model, batch)
        processed = self.staged.stage(s)
        grouping, needs = self._grouping(processed, selected, model)
        main_rows = self.examples.main_pass_rows(
            processed,
            s,
            batch,
            [g for g, n in zip(grouping, needs) if n.examples and g.records],
        )
        records = [r for g, n in zip(grouping, needs) if n.kronecker for r in g.records]
        records += [r for g in main_rows.groups + main_rows.outer for r in g.records]
        lin = stats.layer_outputs_vjp(
            processed,
            s,
            records,
            value_and_grad=value_and_grad,
            per_example=_summed(grouping, needs),
        )
        _check_examples(lin.losses, self.caller)
        grads = None
        if lin.grad_vjp is not None:  # with `value_and_grad`
            assert cotangent_fn is not None, "value_and_grad needs a cotangent_fn"
            # The gradient and the curvature vectors are pulled back separately:
            # batching them would also compute K unused weight gradients, which
            # XLA cannot remove from a batched product.
            (grads,) = lin.grad_vjp(cotangent_fn(lin.program_outputs))
        return Linearised(
            model, batch, s, processed, selected, grouping, needs, main_rows, lin, grads
        )

    def curvature(
        self, forward: Linearised, key, factor_rows: dict[str, int] | None = None
    ) -> tuple[Curvature, MainPass]:
        """The later phases, from `linearise`'s forward: the estimator's vectors
        pulled back (`_main_pass`), the per-example vectors, the blocks and the
        `Curvature`. `factor_rows`, if given, is filled with the number of rows
        each group's K-FAC input factor averages, by group name."""
        grouping, needs = forward.grouping, forward.needs
        main = self._main_pass(forward, key)
        steps_cache = {}
        rows, outers = self._rows(main, grouping, needs, steps_cache)
        factor_rows = {} if factor_rows is None else factor_rows

        def statistics(j):
            return self._statistics(
                grouping[j], needs[j], main, rows, outers, steps_cache, factor_rows
            )

        blocks = self._blocks(grouping, needs, forward.processed, statistics)
        params = eqx.filter(forward.model, eqx.is_inexact_array)
        curv = _assemble(params, blocks, grouping, forward.processed, forward.selected)
        check_fits(self.caller, curv)
        return _refused_derivatives(self.caller, curv), main

    def _main_pass(self, forward: Linearised, key) -> MainPass:
        """The forward's VJP of the estimator's output vectors: the layers' output
        cotangents, for the Kronecker factors and the per-example vectors the
        `examples` option takes from this pass."""
        lin, main_rows = forward.lin, forward.main_rows
        per_loss = loss_vectors(
            self.estimator, _refused_derivatives(self.caller, lin.losses), key
        )
        _, cotangents = _pull_each(lin.vjp, stacked_vectors(per_loss))
        if self.estimator.splits_positions and any(v.ndim > 3 for v in per_loss):
            # An example's vectors are not its part of the batch's.
            main_rows = MainPassRows(
                n_examples=main_rows.n_examples, labels=main_rows.labels
            )
        return MainPass(
            model=forward.model,
            batch=forward.batch,
            split=forward.split,
            processed=forward.processed,
            program_outputs=lin.program_outputs,
            losses=lin.losses,
            vjp=lin.vjp,
            layer_inputs=lin.layer_inputs,
            per_loss=tuple(per_loss),
            cotangents=cotangents,
            grads=forward.grads,
            main_rows=main_rows,
        )

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

    def _statistics(
        self,
        g: Group,
        n: Needs,
        main: MainPass,
        rows,
        outers,
        steps_cache: dict,
        factor_rows: dict[str, int],
    ) -> Statistics:
        """One group's `Statistics`: Kronecker factors from the main pass's layer
        inputs and output cotangents (the rows A averages noted in `factor_rows`),
        per-example vectors from `rows`, as it needs."""
        dtype, with_bias = _dtype_and_bias(g, main)
        a = gg = outer = None
        if n.kronecker:
            size = main.losses[0].inputs.shape[0]
            reduce = _reduce_examples(
                self.structure, n, g, size, self.caller, self.examples, main
            )
            # Every step's use of a weight in a kept scan at once, from the
            # scan's stacked values: the work does not grow with the steps.
            a, gg, factor_rows[g.name] = stats.pooled_factors(
                g.records,
                main.layer_inputs,
                main.cotangents,
                with_bias,
                dtype,
                reduce_examples=reduce,
                max_factor_dim=n.max_factor_dim,
                steps_cache=steps_cache,
            )
        group_rows = None
        if n.examples and g.name in outers:
            outer = outers[g.name]
            perm = g.records[0].weight_perm
            assert perm is not None  # a dense layer's weight
            # Formed for a structure that reads them (`Statistics.full`); XLA
            # drops them where only `outer`'s products are used.
            group_rows = formed_rows(outer, perm, g.shapes)
        elif n.examples:
            group_rows = tuple(rows[i].astype(dtype) for i in g.param_indices)
        return Statistics(
            g.shapes,
            a,
            gg,
            g.records[0].weight_perm if n.kronecker or outer is not None else None,
            group_rows,
            outer,
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
        want = [tuple(x.shape) for x in g.shapes]
        got = [tuple(x.shape) for x in jax.tree_util.tree_leaves(block.in_structure())]
        if got != want:
            raise ValueError(
                f"`{self.caller}(..., structure={self.structure!r})`: "
                f"`{type(self.structure).__name__}.block` returned, for group "
                f"`{g.name}`, a block on parameters shaped {got}; the group's are "
                f"{want} (in that order: `statistics.shapes`)."
            )
        floats = lambda tree: [  # noqa: E731
            x.dtype
            for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        bits = [jnp.finfo(d).bits for d in floats(statistics)]
        narrow = [d for d in floats(block) if bits and jnp.finfo(d).bits < max(bits)]
        if narrow:
            # A float32 block of float64 statistics rounded them, silently.
            raise TypeError(
                f"`{self.caller}(..., structure={self.structure!r})`: "
                f"`{type(self.structure).__name__}.block` returned, for group "
                f"`{g.name}`, a block holding {jnp.dtype(narrow[0]).name} arrays, "
                f"narrower than its statistics' {max(bits)}-bit floats: build it in "
                "their dtype."
            )
        return block

    def _rows(
        self, main: MainPass, grouping, needs, steps_cache: dict
    ) -> tuple[dict, dict]:
        """`(rows, outer)`: per parameter number, the exact per-example vectors
        `(m, *shape)` of the groups that need them, as the `examples` option
        computes them; per group name, the factors of the groups whose vectors
        are outer products from the main pass (`outer_rows.py`). Both refused
        where the examples interact."""
        parts = sorted(
            {i for g, n in zip(grouping, needs) if n.examples for i in g.param_indices}
        )
        if not parts:
            return {}, {}
        rows, interact = self.examples.rows(self.staged, self.estimator, main, parts)
        names = {g.name for g in main.main_rows.outer}
        outer = {
            g.name: _outer_factors(g, main, steps_cache)
            for g, n in zip(grouping, needs)
            if n.examples and g.name in names
        }
        if interact is None:
            return rows, outer
        message = f"`{self.staged.caller}`: {INTERACTION}"
        return refused_where((rows, outer), interact, message)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _not_differentiable(caller: str, leaves: list) -> list:
    """The curvature's arrays, refusing a derivative through them: the statistics
    treat the estimator's vectors as constants (`loss_vectors`' stop_gradient,
    which K-FAC's statistics want), so a derivative in the parameters or the batch
    would be wrong. A derivative that does not reach them (in a damping, a prior
    precision) is unaffected."""
    return leaves


def _refuse_tangents(caller: str, primals, tangents):
    (leaves,), (tangents,) = primals, tangents
    if not all(isinstance(t, SymbolicZero) for t in tangents):
        raise ValueError(
            f"`{caller}`: the curvature is not differentiable in the model's "
            "parameters or the batch (its targets, masks and loss coefficients "
            "included): its statistics hold the estimator's vectors "
            "constant, so a derivative through them would be wrong. To use the "
            "curvature as a constant (a preconditioner, a posterior's precision), "
            "pass `eqfisher.filters.stop_gradient(model, True)` and "
            "`jax.lax.stop_gradient(batch)`; for derivatives of curvature "
            "products, differentiate `eqfisher.ggn_operator(...).mv` or "
            "`jax.hessian`. (The value and gradient of `value_grad_and_curvature` "
            "come with the curvature: to differentiate them, compute them with "
            "`eqx.filter_value_and_grad`.)"
        )
    return leaves, tangents


_not_differentiable.defjvp(_refuse_tangents, symbolic_zeros=True)


def _refused_derivatives(caller: str, tree: PyTree) -> PyTree:
    """`tree`, refusing a derivative through its arrays (`_not_differentiable`):
    the curvature, and the registered losses the estimator's vectors are made
    from (their inputs, targets, masks and coefficients), since the vectors are
    held constant and a derivative in the targets, the mask or a coefficient
    would otherwise be zero where it is not."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, _not_differentiable(caller, leaves))


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
    units = [[processed.units[i] for i in g.param_indices] for g in grouping]
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


def _dtype_and_bias(g: Group, main: MainPass):
    """A group's statistics dtype (its widest leaf's, at least float32) and
    whether it holds a layer's bias beside its weight. (`Dense()`'s one group
    over float32 and float64 leaves is float64: float32 would round the float64
    leaves' curvature at 1e-7.)"""
    dtypes = [
        main.processed.unit_shape(main.split.params, i)[1] for i in g.param_indices
    ]
    widest = max(dtypes, key=lambda d: jnp.finfo(d).bits)
    return at_least_float32(widest), len(g.param_indices) == 2


def _outer_factors(g: Group, main: MainPass, steps_cache: dict):
    """`outer_rows.outer_factors` of a group's one dense layer."""
    (record,) = g.records
    dtype, with_bias = _dtype_and_bias(g, main)
    return outer_factors(
        record, main.layer_inputs, main.cotangents, with_bias, dtype, steps_cache
    )


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


def _reduce_examples(
    structure,
    n: Needs,
    g: Group,
    size: int,
    caller: str,
    examples: AbstractExamples,
    main: MainPass,
):
    if n.weight_sharing != "reduce":
        return None
    if not examples.batch_leads():
        # The layer's locations do not say where the examples are: "reduce" takes
        # them as its first location axis, the batch's leading one.
        raise ValueError(
            f'`{caller}(..., structure={structure!r})`: "reduce" averages each '
            "example's inputs over the layer's locations, with the examples on the "
            f"leading axis of the batch, but `examples={examples!r}` puts them "
            "elsewhere. Put the example axis first (e.g. `x.swapaxes(0, 1)` for a "
            'time-major batch), or use weight_sharing="expand".'
        )
    _check_reduced_axis(structure, g, caller, main)
    first = stats.example_axis_size(g.records[0])
    if first != size:
        raise ValueError(
            f'`{caller}(..., structure={structure!r})`: "reduce" needs the layer\'s '
            f"first location axis to be the example axis, but layer `{g.name}` has "
            f"{first} there and the loss {size} examples."
        )
    return size


def _check_reduced_axis(structure, g: Group, caller: str, main: MainPass) -> None:
    """Refuses "reduce" for a layer whose examples are, by the tracer's labels, on
    another than its first location axis: a readout vmapped over a scan's outputs
    under the examples' vmap has time first, and was reduced over the examples
    when there were as many steps as examples."""
    labels = main.main_rows.labels or proven_labels(
        main.processed.program, main.split, main.batch, 0, caller
    )
    if labels is None:
        return
    for record in g.records:
        axis = label_of(labels, record.outputs)  # None: shared; -1: mixed
        if axis is not None and axis >= 0 and axis != record.out_order[0]:
            raise ValueError(
                f'`{caller}(..., structure={structure!r})`: "reduce" averages '
                "each example's inputs over the layer's locations, taking the "
                f"examples on its first location axis, but layer `{g.name}` has "
                f"them on its output's axis {axis}, and its first location axis "
                f"is axis {record.out_order[0]} (e.g. a layer mapped over a "
                "`lax.scan`'s outputs under the examples' `jax.vmap`: time comes "
                "first). Apply the layer inside the scan's body, "
                'or give it weight_sharing="expand" (`eqfisher.PerLayer`).'
            )
