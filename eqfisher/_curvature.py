"""`Curvature`: the blocks of a whole model, as one lineax operator, and the
functions that build it (`curvature`, `value_grad_and_curvature`)."""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree, ScalarLike

from . import _statistics as stats, filters
from ._config import Config, current_config
from ._estimators import AbstractEstimator, loss_vectors, stacked_vectors
from ._example_axes import proven_labels
from ._examples import AbstractExamples, IndependentExamples, InteractingExamples
from ._per_example import (
    INTERACTION,
    example_count,
    examples_mismatch,
    main_pass_rows_possible,
    one_example,
    per_example_vectors,
    shift_rows,
)
from ._structures import (
    AbstractStructure,
    Group,
    Needs,
    Statistics,
    candidates,
    check_groups,
    matrix_gib,
)
from ._tracing import Traced, split
from .blocks import AbstractBlock
from .blocks._base import register_psd_operator
from .filters import AbstractFilter


class Curvature(lx.AbstractLinearOperator):
    """The curvature of a model: typed blocks over its parameter PyTree.

    A lineax operator on PyTrees like `eqx.filter(model, eqx.is_inexact_array)` (or
    the `where` subset, other leaves `None`). Dense matrices (`as_matrix`) order
    rows and columns as `jax.flatten_util.ravel_pytree` of that PyTree.

    **Fields:**

    - `blocks`: a dict from block name (the layer's model path, or a parameter path
      for a leaf in no layer; `"all"` for `Dense()`) to an `eqfisher.blocks` block.
    - `leaf_indices`: static; `(name, positions)` pairs: for each block, the
      positions of its leaves among the operand's leaves.
    - `structure`: static; the operand as a PyTree of `jax.ShapeDtypeStruct`.
    - `leaf_slices`: static; parallel to `leaf_indices`: for each block and each of
      its positions, the index into that leaf's leading axes (`()`: the whole
      leaf). A stacked leaf read by a `lax.scan` has one block per step, each on
      its slice `leaf[k]`. `None` when every block covers whole leaves.

    !!! Example

        Every method agrees with the dense matrix:

        ```python
        from jax.flatten_util import ravel_pytree

        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        print(list(curv.blocks))  # ['layers[0]', 'layers[1]']
        C = curv.as_matrix()  # (67, 67), rows in ravel_pytree(params) order
        assert C.shape == (67, 67)
        flat = lambda tree: ravel_pytree(tree)[0]
        assert jnp.allclose(flat(curv.mv(grads)), C @ flat(grads), atol=1e-6)
        assert jnp.allclose(flat(curv.diagonal()), jnp.diag(C), atol=1e-6)
        assert jnp.allclose(curv.trace(), jnp.trace(C), rtol=1e-5)
        step = curv.solve(grads, 0.1)  # (C + 0.1 I)⁻¹ g
        assert jnp.allclose(C @ flat(step) + 0.1 * flat(step), flat(grads), atol=1e-5)
        _, logdet = jnp.linalg.slogdet(C + 0.1 * jnp.eye(67))
        assert jnp.allclose(curv.logdet(0.1), logdet, rtol=1e-4)
        ```
    """

    blocks: dict[str, AbstractBlock]
    leaf_indices: tuple[tuple[str, tuple[int, ...]], ...] = eqx.field(static=True)
    structure: PyTree = eqx.field(static=True)
    leaf_slices: tuple[tuple[tuple[int, ...], ...], ...] | None = eqx.field(
        static=True, default=None
    )

    def _parts(self):
        """`(name, positions, slices)` for each block."""
        slices = self.leaf_slices or [((),) * len(i) for _, i in self.leaf_indices]
        return [(n, i, sl) for (n, i), sl in zip(self.leaf_indices, slices)]

    def _leaves(self, vector: PyTree, method: str) -> tuple[list[Array], Any]:
        # Leaves are matched by position and shape rather than by tree structure, so
        # that a vector whose unselected leaves are `None` or `optax.MaskedNode()`
        # (inside `optax.masked`) is accepted alike.
        leaves, treedef = jax.tree_util.tree_flatten(vector)
        shapes = [s.shape for s in jax.tree_util.tree_leaves(self.structure)]
        if [jnp.shape(x) for x in leaves] != shapes:
            raise ValueError(
                f"`Curvature.{method}(vector)`: `vector` must have the structure of "
                "the parameters the curvature covers (eqx.filter(model, "
                "eqx.is_inexact_array), restricted by `where`); its leaves have shapes "
                f"{[jnp.shape(x) for x in leaves]}, expected {shapes}."
            )
        return leaves, treedef

    def _map(self, vector: PyTree, fn: Callable, method: str) -> PyTree:
        leaves, treedef = self._leaves(vector, method)
        out = list(leaves)
        # Blocks are found by name: a dict passing through `jit` comes back sorted.
        for name, idx, sl in self._parts():
            block = self.blocks[name]
            parts = tuple(leaves[i][k] if k else leaves[i] for i, k in zip(idx, sl))
            for i, k, x in zip(idx, sl, fn(block, parts)):
                out[i] = out[i].at[k].set(x) if k else x
        return jax.tree_util.tree_unflatten(treedef, out)

    def mv(self, vector: PyTree) -> PyTree:
        """The product $C v$, for `vector` shaped like the parameters (a PyTree like
        `eqx.filter(model, eqx.is_inexact_array)`, restricted by `where`).

        **Raises:**

        `ValueError` when `vector`'s leaves do not have the parameters' shapes.

        !!! Example

            With `model`, `batch` and `loss_fn` as in `eqfisher.curvature`'s example:

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
            )
            grads = eqx.filter_grad(loss_fn)(model, batch)
            cg = curv.mv(grads)  # a PyTree like grads
            flat = jax.flatten_util.ravel_pytree
            assert jnp.allclose(flat(cg)[0], curv.as_matrix() @ flat(grads)[0])
            ```
        """
        return self._map(vector, lambda b, v: b.mv(v), "mv")

    def solve(self, vector: PyTree, damping: ScalarLike) -> PyTree:
        r"""$(C + \text{damping} \cdot I)^{-1} v$, exact for every block type (K-FAC
        through its factors' eigendecompositions).

        **Arguments:**

        - `vector`: a PyTree shaped like the parameters (a gradient).
        - `damping`: $\lambda \ge 0$, added to every eigenvalue.

        **Returns:**

        A PyTree like `vector`.

        **Raises:**

        `ValueError` when `vector`'s leaves do not have the parameters' shapes, or
        when `damping` is negative (a concrete value) or not a scalar.

        !!! Example

            With `model`, `batch` and `loss_fn` as in `eqfisher.curvature`'s example:

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            grads = eqx.filter_grad(loss_fn)(model, batch)
            step = curv.solve(grads, 1e-3)  # (C + 0.001 I)⁻¹ g, like grads
            ```
        """
        return self._map(vector, lambda b, v: b.solve(v, damping), "solve")

    def as_matrix(self, max_gib: float | int = 1.0) -> Float[Array, "size size"]:
        """The dense matrix, rows and columns in the order of
        `jax.flatten_util.ravel_pytree` of the parameters.

        **Raises:**

        `ValueError` when it would take over `max_gib` GiB.

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            matrix = curv.as_matrix()  # zero between layers: K-FAC is block-diagonal
            assert jnp.allclose(jnp.trace(matrix), curv.trace())
            ```
        """
        sizes = [math.prod(s.shape) for s in jax.tree_util.tree_leaves(self.structure)]
        offsets = np.cumsum([0] + sizes)
        # The statistics' dtype: float32 for a bfloat16 model.
        dtype = stats.stat_dtype(
            jnp.result_type(
                *[s.dtype for s in jax.tree_util.tree_leaves(self.structure)]
            )
        )
        gib = matrix_gib(sizes, dtype)
        if gib > max_gib:
            raise ValueError(
                f"`Curvature.as_matrix()`: the {offsets[-1]:,}² matrix would take "
                f"{gib:.2f} GiB, above `max_gib` = {max_gib}. Use `mv`, `solve`, "
                "`diagonal`, `logdet`, or one block's `curv.blocks[name].as_matrix()`"
                "; or raise the limit with `as_matrix(max_gib=...)`."
            )
        out = jnp.zeros((offsets[-1], offsets[-1]), dtype)
        shapes = [s.shape for s in jax.tree_util.tree_leaves(self.structure)]
        for name, idx, sl in self._parts():
            block = self.blocks[name]
            pos = np.concatenate(
                [
                    offsets[i] + np.arange(sizes[i]).reshape(shapes[i])[k].ravel()
                    for i, k in zip(idx, sl)
                ]
            )
            out = out.at[np.ix_(pos, pos)].set(block.as_matrix().astype(dtype))
        return out

    def diagonal(self) -> PyTree:
        """The diagonal, as a PyTree like the parameters.

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            d = curv.diagonal()  # each block's own diagonal, without a dense matrix
            flat = jax.flatten_util.ravel_pytree(d)[0]
            assert jnp.allclose(flat, jnp.diagonal(curv.as_matrix()))
            ```
        """
        zero = jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype), self.structure
        )
        return self._map(zero, lambda b, v: b.diagonal(), "diagonal")

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        r"""$\log \det(C + \text{damping} \cdot I)$, the sum of the blocks' (K-FAC's
        from its factors' eigenvalues; no dense matrix is formed).

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            size = curv.as_matrix().shape[0]
            _, dense = jnp.linalg.slogdet(curv.as_matrix() + 0.1 * jnp.eye(size))
            assert jnp.allclose(curv.logdet(0.1), dense, rtol=1e-4)
            ```
        """
        return sum(b.logdet(damping) for b in self.blocks.values())

    def trace(self) -> Float[Array, ""]:
        """The trace, the sum of the blocks' traces (no dense matrix is formed).

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            assert jnp.allclose(curv.trace(), jnp.trace(curv.as_matrix()))
            ```
        """
        return sum(b.trace() for b in self.blocks.values())

    def ema(self, other: "Curvature", decay: ScalarLike) -> "Curvature":
        r"""The moving average $\text{decay} \cdot \text{self} + (1 - \text{decay})
        \cdot \text{other}$, block by block (see each block's `ema`: K-FAC averages
        its factors).

        **Raises:**

        `ValueError` when `other` has other blocks.

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Diagonal()
            )
            half = curv.ema(curv.ema(curv, 0.0), 0.5)  # the average of curv with itself
            assert jnp.allclose(half.as_matrix(), curv.as_matrix())
            ```
        """
        if other.blocks.keys() != self.blocks.keys():
            raise ValueError("`Curvature.ema(other, decay)`: `other` has other blocks.")
        new = {k: b.ema(other.blocks[k], decay) for k, b in self.blocks.items()}
        return Curvature(new, self.leaf_indices, self.structure, self.leaf_slices)

    def transpose(self) -> "Curvature":
        """The curvature itself: every curvature is symmetric."""
        return self

    def in_structure(self) -> PyTree:
        """The operand, a PyTree of `jax.ShapeDtypeStruct` like the parameters."""
        return self.structure

    def out_structure(self) -> PyTree:
        """As `in_structure`: the operator is square."""
        return self.structure


register_psd_operator(Curvature)


def _check_args(caller: str, estimator, structure, key, examples) -> None:
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


class _Builder(eqx.Module):
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
            processed, s, records, full=full
        )
        per_loss = loss_vectors(self.estimator, losses, key)
        vectors = stacked_vectors(per_loss)
        grads = None
        if full:
            # The gradient and the curvature vectors are pulled back separately:
            # batching them would also compute K unused weight gradients, which
            # XLA cannot remove from a batched product.
            (grads,) = grad_vjp(cotangent_fn(outputs[0]))
        _, point_ct = jax.vmap(vjp)(vectors)
        if not all(self.estimator.example_vectors(v) is v for v in per_loss):
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
            (shifts, n_examples, labels, inputs, point_ct),
        )
        blocks, steps_cache = {}, {}
        for g, n in zip(grouping, needs):
            statistics = self._statistics(
                g,
                n,
                processed,
                s,
                (inputs, point_ct, steps_cache),
                rows,
                losses[0].inputs.shape[0],
            )
            blocks[g.name] = self._block(g, statistics)
        params = eqx.filter(model, eqx.is_inexact_array)
        curv = _assemble(params, blocks, grouping, processed, selected)
        return curv, outputs, grads, s

    def _grouping(self, processed, selected, model):
        """The structure's groups, in parameter order, and what each needs."""
        found = candidates(
            processed,
            selected,
            stats.unsupported,
        )
        grouping = check_groups(
            self.structure,
            self.structure.groups(found, model, self.caller),
            found,
            self.caller,
        )
        grouping = sorted(grouping, key=lambda g: min(g.units))
        return grouping, [_needs(self.structure, g, self.caller) for g in grouping]

    def _statistics(self, g, n, processed, s, pulled, rows, batch_size) -> Statistics:
        """One group's `Statistics`: Kronecker factors from the layers' inputs and
        output cotangents `pulled`, per-example vectors from `rows`, as it needs."""
        values = tuple(processed.take(s.params, i) for i in g.leaves)
        dtype = stats.stat_dtype(values[0].dtype)
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
        main pass (see `_per_example.py`), scale-and-shift layers with independent
        examples; the number of examples; and the labels of `_example_axes` when
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
        groups that need them: from the main pass where `main` (groups, layer
        inputs, output cotangents) allows, else from a pass per example."""
        shifts, n_examples, labels, inputs, point_ct = main
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
            if rest:
                leaves = sorted({processed.units[i][0] for i in rest})
                vecs, mismatch = per_example_vectors(
                    one,
                    per_loss,
                    full_inputs,
                    lambda v: stacked_vectors(
                        [self.estimator.example_vectors(x) for x in v]
                    ),
                    leaves,
                )
                rows = _unit_rows(processed, rest, dict(zip(leaves, vecs)))
            else:
                mismatch = examples_mismatch(one, full_inputs)
        if shifts:
            s = split(model, batch)
            shapes = {i: processed.take(s.params, i).shape for i in shifted}
            records = [r for g in shifts for r in g.records]
            rows |= shift_rows(records, inputs, point_ct, n_examples, shapes, labels)
        if mismatch is None:  # proven at trace time (`_example_axes`)
            return rows
        message = f"`{self.caller}`: {INTERACTION}"
        return {i: eqx.error_if(x, mismatch, message) for i, x in rows.items()}


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


def curvature(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    key: PRNGKeyArray | None = None,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = INDEPENDENT,
) -> Curvature:
    """The curvature of the value `loss_fn(model, batch)` returns.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar`, with its loss registered
      (`eqfisher.softmax_cross_entropy`, ...).
    - `model`, `batch`: PyTrees; the model's inexact arrays are the parameters.
    - `estimator`: `GGN()`, `FisherExact()`, `FisherMC(samples=...)` or
      `EmpiricalFisher()`.
    - `structure`: `Dense()`, `BlockDiagonal()`, `Diagonal()`, `KFAC()`, `EKFAC()`,
      `PerLayer(...)` (structures per layer, chosen with filters), or a subclass of
      `AbstractStructure`.
    - `key`: a PRNG key, needed by `FisherMC`.
    - `where`: a filter (`eqfisher.filters`) restricting the parameters covered.
    - `examples`: `IndependentExamples(axis=0)` (default) or
      `InteractingExamples()`: how the batch's examples relate inside `loss_fn`,
      for the structures that need per-example vectors.

    **Returns:**

    A `Curvature`, a lineax operator over the (selected) parameters.

    **Raises:**

    - `TypeError` when `estimator`, `structure` or `examples` is not one of
      eqfisher's types.
    - `ValueError` when `FisherMC` gets no `key`, when `where` selects no
      parameter, when `loss_fn` registers no loss or its value is not affine in the
      registered losses, or when examples interact inside `loss_fn` (BatchNorm
      statistics) under `IndependentExamples()`; each message names the fix.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 3, 8, 1, key=jax.random.key(0))
        batch = (jnp.ones((16, 2)), jnp.zeros(16, dtype=int))  # inputs, labels

        def loss_fn(model, batch):
            x, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model)(x), y)

        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        print(curv.blocks.keys())  # layers[0], layers[1]: KroneckerFactored
        print(curv.as_matrix().shape)  # (59, 59)
        ```
    """
    _check_args("eqfisher.curvature", estimator, structure, key, examples)
    return _curvature_jit(
        loss_fn,
        model,
        batch,
        estimator,
        structure,
        key,
        where,
        examples,
        current_config(),
    )


# Compiled even when called eagerly: the interpreted program would otherwise run op
# by op. Inside an outer `jit` this is an ordinary nested call.
@eqx.filter_jit
def _curvature_jit(
    loss_fn, model, batch, estimator, structure, key, where, examples, config: Config
):
    # `config` is a static argument: a changed setting (`eqfisher.configure`)
    # compiles anew instead of reusing a program traced under another.
    del config
    caller = "eqfisher.curvature"
    builder = _Builder(
        Traced(loss_fn, caller), estimator, structure, where, caller, examples
    )
    return builder(model, batch, key, full=False)[0]


def value_grad_and_curvature(
    loss_fn: Callable,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    has_aux: bool = False,
    surrogate: bool = False,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = INDEPENDENT,
) -> Callable:
    """Loss, gradient and curvature from one forward pass and one stacked VJP.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, returning the scalar loss, or
      `(loss, aux)` with `has_aux=True`, or `(loss, gradient_surrogate)` with
      `surrogate=True` (gradients are those of the surrogate, the value reported is
      the loss, curvature that of the registered losses).
    - `estimator`, `structure`, `where`, `examples`: as for `eqfisher.curvature`.

    **Returns:**

    A function `(model, batch, *, key=None) -> (value, grads, curvature)`; `value`
    is `(loss, aux)` with `has_aux`; `grads` is shaped like `eqx.filter_grad`'s.
    For K-FAC the curvature statistics come from the same forward and VJP as the
    gradient; structures that need exact per-example Jacobians (`Dense`,
    `BlockDiagonal`, `Diagonal`, EKFAC's scales, leaves in no layer) add a
    per-example pass.

    **Raises:**

    `ValueError` when both `has_aux` and `surrogate` are set; at the first call,
    the errors of `eqfisher.curvature`.

    !!! Example

        With `model`, `batch` and `loss_fn` as in `eqfisher.curvature`'s example:

        ```python
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )
        loss, grads, curv = vgc(model, batch, key=jax.random.key(1))
        ```
    """
    caller = "eqfisher.value_grad_and_curvature"
    traced = Traced(loss_fn, caller, _returns(caller, has_aux, surrogate))
    cotangent_fn = functools.partial(_cotangents, which=1 if surrogate else 0)

    def fn(model, batch, *, key=None):
        _check_args(caller, estimator, structure, key, examples)
        return compiled(model, batch, key, current_config())

    @eqx.filter_jit
    def compiled(model, batch, key, config: Config):
        del config  # static: see `_curvature_jit`
        builder = _Builder(traced, estimator, structure, where, caller, examples)
        curv, outputs, grads, _ = builder(
            model, batch, key, full=True, cotangent_fn=cotangent_fn
        )
        value = _value(loss_fn, model, batch, outputs[0], has_aux)
        return value, _like_params(model, grads), curv

    return fn


def _returns(caller: str, has_aux: bool, surrogate: bool) -> str:
    """What `loss_fn` returns, as `Traced` names it: `"aux"`, `"surrogate"` or
    `"loss"`."""
    if has_aux and surrogate:
        raise ValueError(f"`{caller}`: pass at most one of `has_aux` and `surrogate`.")
    return "aux" if has_aux else "surrogate" if surrogate else "loss"


def _cotangents(outputs, which: int) -> tuple:
    """The cotangent that pulls back the gradient of `outputs[which]` alone: ones
    there, zeros (`float0` for integer outputs) elsewhere."""
    # Outputs may be Python scalars (an aux built from shapes): `jnp.shape`.
    return tuple(
        (jnp.ones_like(o) if i == which else jnp.zeros_like(o))
        if jnp.issubdtype(jnp.result_type(o), jnp.inexact)
        else np.zeros(jnp.shape(o), jax.dtypes.float0)
        for i, o in enumerate(outputs)
    )


def _value(loss_fn, model, batch, program_outputs, has_aux: bool):
    """The loss, or `(loss, aux)` with `has_aux` (aux rebuilt in `loss_fn`'s
    output structure)."""
    loss = program_outputs[0]
    if not has_aux:
        return loss
    out_shape = eqx.filter_eval_shape(loss_fn, model, batch)
    aux = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(out_shape[1]), list(program_outputs[1:])
    )
    return loss, aux


def _like_params(model: PyTree, leaves) -> PyTree:
    """The gradient's leaves in the structure of `eqx.filter_grad`'s result."""
    params = eqx.filter(model, eqx.is_inexact_array)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)
