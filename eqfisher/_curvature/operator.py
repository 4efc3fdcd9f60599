"""`Curvature`: the blocks of a whole model, as one lineax operator over its
parameter PyTree."""

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, PyTree, ScalarLike

from .._precision import at_least_float32
from ..blocks import AbstractBlock
from ..blocks._base import check_scalar, register_psd_operator
from .structures import check_gib, matrix_gib


def _cast_like(fn: Callable, block, parts: tuple) -> tuple:
    return tuple(
        jnp.asarray(x).astype(p.dtype) for x, p in zip(fn(block, parts), parts)
    )


class _ByValue:
    """A PyTree of `jax.ShapeDtypeStruct`s that compares (and hashes) by its tree
    definition and leaves: a static field holding the parameters' own containers
    compared them with `==`, which a container class without `__eq__` answers by
    identity (so two curvatures of one model had other tree structures)."""

    __slots__ = ("key", "tree")

    def __init__(self, tree: PyTree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        self.tree = tree
        self.key = (treedef, tuple((x.shape, np.dtype(x.dtype)) for x in leaves))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


class Curvature(lx.AbstractLinearOperator):
    """The curvature of a model: typed blocks over its parameter PyTree.

    A lineax operator on PyTrees like `eqx.filter(model, eqx.is_inexact_array)` (or
    the `where` subset, other leaves `None`). Dense matrices (`as_matrix`) order
    rows and columns as `jax.flatten_util.ravel_pytree` of that PyTree.

    **Fields:**

    - `blocks`: a dict from block name (the layer's model path, or a parameter path
      for a leaf in no layer; `"all"` for `Dense()`) to an `eqfisher.blocks` block.
      A property: the blocks of a layer stacked with `eqx.filter_vmap` and applied
      by `lax.scan` (one per step) are stored as one block whose arrays have a
      leading step axis (`stored`, `runs`), so that a jitted function returning the
      curvature outputs one array per stacked factor, not one per step. Such a
      step's block is a view: `eqx.tree_at` replaces the stacked block in `stored`.
    - `leaf_indices`: static; `(name, positions)` pairs: for each block, the
      positions of its leaves among the operand's leaves.
    - `structure`: static; the operand as a PyTree of `jax.ShapeDtypeStruct`.
    - `leaf_slices`: static; parallel to `leaf_indices`: for each block and each of
      its positions, the index into that leaf's leading axes (`()`: the whole
      leaf). A stacked leaf read by a `lax.scan` has one block per step, each on
      its slice `leaf[k]`. `None` when every block covers whole leaves.
    - `stored`: the blocks as stored: a stacked layer's steps as one block under
      its first step's name, its arrays with a leading step axis.
    - `runs`: static; the names of the steps of each stacked layer in `stored`.

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

    stored: dict[str, AbstractBlock]
    leaf_indices: tuple[tuple[str, tuple[int, ...]], ...] = eqx.field(static=True)
    _operand: _ByValue = eqx.field(static=True)
    leaf_slices: tuple[tuple[tuple[int, ...], ...], ...] | None = eqx.field(
        static=True, default=None
    )
    runs: tuple[tuple[str, ...], ...] = eqx.field(static=True, default=())

    def __init__(
        self,
        blocks: dict[str, AbstractBlock],
        leaf_indices: tuple[tuple[str, tuple[int, ...]], ...],
        structure: PyTree,
        leaf_slices: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
    ):
        """**Arguments:** `blocks`, `leaf_indices`, `structure` and `leaf_slices` as
        described above. The blocks of the steps of a stacked layer (one per step,
        on the slices `leaf[0]`, `leaf[1]`, ... of the same leaves, all of one type
        and shape) are stored as one block whose arrays have a leading step axis:
        `blocks` gives them back one by one."""
        self.leaf_indices = leaf_indices
        self._operand = _ByValue(structure)
        self.leaf_slices = leaf_slices
        self.runs = _runs(blocks, leaf_indices, leaf_slices)
        in_runs = {name for run in self.runs for name in run[1:]}
        stored = {n: b for n, b in blocks.items() if n not in in_runs}
        for run in self.runs:
            stored[run[0]] = jax.tree_util.tree_map(
                lambda *xs: _stack(xs), *(blocks[n] for n in run)
            )
        self.stored = stored

    @property
    def structure(self) -> PyTree:
        """The operand as a PyTree of `jax.ShapeDtypeStruct` (see above)."""
        return self._operand.tree

    @property
    def blocks(self) -> dict[str, AbstractBlock]:
        """A dict from block name to block (see above), in the order of
        `leaf_indices`."""
        out = dict(self.stored)
        steps = {name for run in self.runs for name in run}
        if _placeholders([out[run[0]] for run in self.runs]):
            # `eqx.tree_at` calls `where` on placeholders for the leaves: the blocks
            # not stacked are parts of the PyTree and can be replaced; a step's
            # block is a view, and naming one gives `_StepViews`' refusal.
            return _StepViews(
                {n: out[n] for n, _ in self.leaf_indices if n not in steps}, steps
            )
        for run in self.runs:
            stacked = self._stacked(run)
            del out[run[0]]
            for step, name in enumerate(run):
                out[name] = jax.tree_util.tree_map(
                    lambda x, k=step: _take(x, k), stacked
                )
        return {name: out[name] for name, _ in self.leaf_indices}

    def _stacked(self, run: tuple[str, ...]) -> AbstractBlock:
        """The stored block of the steps `run` of a stacked layer, checked to have
        their leading step axis (`eqx.tree_at` could put one step's block there)."""
        block = self.stored[run[0]]
        shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(block)]
        if not all(s[:1] == (len(run),) for s in shapes):
            raise ValueError(
                f"`Curvature`: the stored block `{run[0]}` holds the {len(run)} steps "
                f"{list(run)} of a stacked layer, so its arrays need a leading axis "
                f"of {len(run)}; they have shapes {shapes}. To replace it with "
                f"`eqx.tree_at(lambda c: c.stored[{run[0]!r}], curv, new)`, stack "
                "the steps' blocks, `jax.tree.map(lambda *x: jnp.stack(x), "
                "*steps)`, or transform them with `curv.map_blocks(fn)`."
            )
        return block

    def _parts(self):
        """`(name, positions, slices)` for each block."""
        slices = self.leaf_slices or [((),) * len(i) for _, i in self.leaf_indices]
        return [(n, i, sl) for (n, i), sl in zip(self.leaf_indices, slices)]

    def _leaves(self, vector: PyTree, method: str) -> tuple[list[Array], Any]:
        # Leaves are matched by position and shape rather than by tree structure, so
        # that a vector whose unselected leaves are `None` or `optax.MaskedNode()`
        # (inside `optax.masked`) is accepted alike.
        paths, treedef = jax.tree_util.tree_flatten_with_path(vector)
        leaves = [x for _, x in paths]
        shapes = [s.shape for s in jax.tree_util.tree_leaves(self.structure)]
        if leaf_shapes(leaves) == shapes:
            # The same shapes at other places (another layer of the same shapes,
            # selected by another `where`; a list of the leaves) would be taken
            # for the parameters': the leaves' paths must be theirs too.
            want = [
                p for p, _ in jax.tree_util.tree_flatten_with_path(self.structure)[0]
            ]
            moved = [
                (jax.tree_util.keystr(p), jax.tree_util.keystr(q))
                for (p, _), q in zip(paths, want)
                if p != q
            ]
            if moved:
                raise ValueError(
                    f"`Curvature.{method}(vector)`: `vector` must have the structure "
                    "of the parameters the curvature covers (eqx.filter(model, "
                    "eqx.is_inexact_array), restricted by `where`: "
                    "`eqfisher.filters.partition(grads, where)[0]`); it has a leaf "
                    f"at {moved[0][0]} where the curvature covers {moved[0][1]}."
                )
        if leaf_shapes(leaves) != shapes:
            raise ValueError(
                f"`Curvature.{method}(vector)`: `vector` must have the structure of "
                "the parameters the curvature covers (eqx.filter(model, "
                "eqx.is_inexact_array), restricted by `where`: "
                "`eqfisher.filters.partition(grads, where)[0]`); its leaves have "
                f"shapes {leaf_shapes(leaves)}, expected {shapes}."
            )
        dtypes = [jnp.result_type(x) for x in leaves]
        if not all(jnp.issubdtype(d, jnp.floating) for d in dtypes):
            raise TypeError(
                f"`Curvature.{method}(vector)`: `vector` must hold floating-point "
                f"arrays, got dtypes {[str(d) for d in dtypes]} (an integer "
                "vector would be truncated, a complex one's imaginary part "
                "dropped). Cast it, e.g. "
                "`jax.tree.map(lambda x: x.astype(float), vector)`."
            )
        return leaves, treedef

    def _map(self, vector: PyTree, fn: Callable, method: str) -> PyTree:
        """`fn(block, parts)` on each block and its parts of `vector`; the steps of
        a stacked layer at once, by `jax.vmap` over the stored block and the
        leading axis of its leaves (one program, not one per step)."""
        leaves, treedef = self._leaves(vector, method)
        out = list(leaves)
        # A block may compute in its statistics' precision (float32 for a
        # bfloat16 model): every result is given back in `vector`'s dtypes.
        fn = functools.partial(_cast_like, fn)
        in_runs = {name for run in self.runs for name in run}
        for name, idx, sl in self._parts():
            if name in in_runs:
                continue
            block = self.stored[name]
            parts = tuple(leaves[i][k] if k else leaves[i] for i, k in zip(idx, sl))
            for i, k, x in zip(idx, sl, fn(block, parts)):
                out[i] = out[i].at[k].set(x) if k else x
        positions = {name: idx for name, idx in self.leaf_indices}
        for run in self.runs:
            n, idx = len(run), positions[run[0]]
            parts = tuple(leaves[i][:n] for i in idx)
            for i, x in zip(idx, jax.vmap(fn)(self._stacked(run), parts)):
                out[i] = x if leaves[i].shape[0] == n else out[i].at[:n].set(x)
        return jax.tree_util.tree_unflatten(treedef, out)

    def mv(self, vector: PyTree) -> PyTree:
        """The product $C v$, for `vector` shaped like the parameters (a PyTree like
        `eqx.filter(model, eqx.is_inexact_array)`, restricted by `where`). Like
        `solve`, it returns each leaf in `vector`'s dtype (a block may compute in
        wider precision: a bfloat16 model's statistics are float32).

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
        - `damping`: $\lambda > 0$, added to every eigenvalue ($C$ is only
          positive-semidefinite: a GGN or Fisher of fewer outputs than parameters
          is singular).

        **Returns:**

        A PyTree like `vector`.

        **Raises:**

        `ValueError` when `vector`'s leaves do not have the parameters' shapes, or
        when `damping` is not a positive scalar (Equinox's runtime error for a
        traced one).

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
        dtype = at_least_float32(
            jnp.result_type(
                *[s.dtype for s in jax.tree_util.tree_leaves(self.structure)]
            )
        )
        check_gib("eqfisher.Curvature.as_matrix", max_gib)
        gib = matrix_gib(sizes, dtype)
        if gib > max_gib:
            raise ValueError(
                f"`Curvature.as_matrix()`: the {offsets[-1]:,}² matrix would take "
                f"{gib:.3g} GiB, above `max_gib` = {max_gib}. Use `mv`, `solve`, "
                "`diagonal`, `logdet`, or one block's `curv.blocks[name].as_matrix()`"
                "; or raise the limit with `as_matrix(max_gib=...)`."
            )
        out = jnp.zeros((offsets[-1], offsets[-1]), dtype)
        shapes = [s.shape for s in jax.tree_util.tree_leaves(self.structure)]
        blocks = self.blocks
        for name, idx, sl in self._parts():
            block = blocks[name]
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

        **Raises:**

        `ValueError` when `damping` is not a positive scalar (as `solve`).

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
        return jnp.asarray(sum(b.logdet(damping) for b in self.blocks.values()))

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
        return jnp.asarray(sum(b.trace() for b in self.blocks.values()))

    def ema(
        self, other: "Curvature", decay: ScalarLike | Mapping[str, ScalarLike]
    ) -> "Curvature":
        r"""The moving average $\text{decay} \cdot \text{self} + (1 - \text{decay})
        \cdot \text{other}$, block by block (see each block's `ema`: K-FAC averages
        its factors). `decay` is one scalar, or a dict from each stored block's
        name (see `stored`) to its own.

        **Raises:**

        `ValueError` when `other` has other blocks (names or structure), or a dict
        `decay` names other blocks than `stored`; a `TypeError` when a block of
        `other` is of another type (a K-FAC block against a diagonal one).

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
        of = self._decays(decay)
        if other.runs != self.runs:
            blocks = other.blocks
            new = {k: b.ema(blocks[k], of[k]) for k, b in self.blocks.items()}
            return Curvature(new, self.leaf_indices, self.structure, self.leaf_slices)
        # A stacked layer's blocks are averaged at once, step by step (`vmap`).
        stacked = {run[0] for run in self.runs}
        stored = {
            k: jax.vmap(lambda x, y, d=of[k]: x.ema(y, d))(b, other.stored[k])
            if k in stacked
            else b.ema(other.stored[k], of[k])
            for k, b in self.stored.items()
        }
        return eqx.tree_at(lambda c: c.stored, self, stored)

    def _decays(self, decay) -> dict[str, Any]:
        """Each block's decay, by the names of `blocks` (a stacked layer's steps
        take their stored block's)."""
        if not isinstance(decay, Mapping):
            return dict.fromkeys(self.blocks, decay)
        if set(decay) != set(self.stored):
            raise ValueError(
                "`Curvature.ema(other, decay)`: a dict `decay` needs one decay for "
                f"each stored block, {sorted(self.stored)}; got {sorted(decay)}."
            )
        # A concrete decay is checked here too, so that a refusal names its block
        # (a traced one is checked once, by the block's `ema`).
        for k, d in decay.items():
            if not isinstance(d, jax.core.Tracer):
                check_scalar(d, f"decay[{k!r}]", jnp.result_type(float), upper=1.0)
        of = dict(decay)
        for run in self.runs:
            of |= dict.fromkeys(run, of[run[0]])
        return of

    def map_blocks(
        self,
        fn: Callable[[AbstractBlock], AbstractBlock],
        names: Sequence[str] | None = None,
    ) -> "Curvature":
        """The curvature with `fn` applied to every block (or to the stored blocks
        in `names`, see `stored`); the steps of a stacked layer at once, by
        `jax.vmap` (so `fn` must be a pure function of the block), which compiles
        one batched computation instead of one per step.

        !!! Example

            ```python
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
            doubled = curv.map_blocks(lambda b: b.scale(2.0))
            assert jnp.allclose(doubled.as_matrix(), 2 * curv.as_matrix())
            ```
        """
        stacked = {run[0] for run in self.runs}
        chosen = self.stored.keys() if names is None else self._known(names)
        stored = {
            k: b if k not in chosen else jax.vmap(fn)(b) if k in stacked else fn(b)
            for k, b in self.stored.items()
        }
        for k in chosen:
            if not isinstance(stored[k], AbstractBlock):
                raise TypeError(
                    "`Curvature.map_blocks(fn, ...)`: `fn` must return a block "
                    "(an `eqfisher.blocks` block, such as `block.scale(2.0)`), got "
                    f"{type(stored[k]).__name__} for block `{k}`."
                )
        return eqx.tree_at(lambda c: c.stored, self, stored)

    def _known(self, names: Sequence[str]) -> set[str]:
        """`names`, checked to be names of stored blocks: a step of a stacked layer
        other than its first, or an unknown name, was ignored."""
        if isinstance(names, str):
            raise TypeError(
                "`Curvature.map_blocks(fn, names=...)`: a sequence of block names, "
                f"such as `names=[{names!r}]`, got the string {names!r}."
            )
        first = {name: run[0] for run in self.runs for name in run[1:]}
        for name in names:
            if name in first:
                raise ValueError(
                    f"`Curvature.map_blocks(fn, names=...)`: `{name}` is a step of "
                    f"a stacked layer, stored (with its other steps) as "
                    f"`{first[name]}`: name that, and `fn` maps every step."
                )
            if name not in self.stored:
                raise ValueError(
                    f"`Curvature.map_blocks(fn, names=...)`: no block `{name}`; the "
                    f"stored blocks are {list(self.stored)}."
                )
        return set(names)

    def transpose(self) -> "Curvature":
        """The curvature itself: every curvature is symmetric."""
        return self

    def in_structure(self) -> PyTree:
        """The operand, a PyTree of `jax.ShapeDtypeStruct` like the parameters."""
        return self.structure

    def out_structure(self) -> PyTree:
        """As `in_structure`: the operator is square."""
        return self.structure


def _signature(block: AbstractBlock) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(block)
    return treedef, tuple((tuple(x.shape), x.dtype) for x in leaves)


def step_runs(entries) -> list[list[int]]:
    """The positions of the entries that are steps 0, 1, ... of one stacked layer.
    `entries` are `(leaves, slices)` pairs: the positions of an entry's leaves and
    each one's index into its leading axes; a step's entry has the one index `(k,)`
    on every leaf, and the steps of a layer share their leaves."""
    steps: dict[tuple[int, ...], dict[int, int]] = {}
    for j, (leaves, slices) in enumerate(entries):
        if slices and all(len(k) == 1 for k in slices) and len(set(slices)) == 1:
            steps.setdefault(tuple(leaves), {})[slices[0][0]] = j
    return [
        [by_step[k] for k in range(len(by_step))]
        for by_step in steps.values()
        if len(by_step) > 1 and sorted(by_step) == list(range(len(by_step)))
    ]


def _runs(blocks, leaf_indices, leaf_slices) -> tuple[tuple[str, ...], ...]:
    """The names of the blocks that are steps 0, 1, ... of one stacked layer
    (`step_runs`), all of one tree structure and shape."""
    if leaf_slices is None:
        return ()
    entries = [(idx, sl) for (_, idx), sl in zip(leaf_indices, leaf_slices)]
    runs = []
    for run in step_runs(entries):
        names = tuple(leaf_indices[j][0] for j in run)
        if len({_signature(blocks[n]) for n in names}) == 1:
            runs.append(names)
    return tuple(runs)


def _stack(xs: tuple) -> Any:
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs)


def _take(x: Any, step: int) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[step]


def _placeholders(blocks: list) -> bool:
    """Whether `blocks` hold `eqx.tree_at`'s placeholders rather than arrays."""
    return any(not hasattr(x, "shape") for x in jax.tree_util.tree_leaves(blocks))


class _StepViews(dict):
    """`Curvature.blocks` while `eqx.tree_at` looks for the nodes it replaces:
    the blocks that are parts of the PyTree, and a refusal for a step of a
    stacked layer, a view of its stored block."""

    def __init__(self, blocks: dict, steps: set[str]):
        super().__init__(blocks)
        self.steps = steps

    def __missing__(self, name: str):
        if name not in self.steps:
            raise KeyError(name)
        raise TypeError(
            f"`Curvature.blocks[{name!r}]`: a stacked layer's blocks are views of "
            "its stored block, one step each, not parts of the PyTree, so "
            "`eqx.tree_at` cannot reach them. Replace the stacked block, "
            "`eqx.tree_at(lambda c: c.stored[run[0]], curv, new)` for a `run` in "
            "`curv.runs`, or transform the steps with `curv.map_blocks(fn)`."
        )


register_psd_operator(Curvature)


@lx.is_diagonal.register(Curvature)
@lx.is_tridiagonal.register(Curvature)
@lx.is_lower_triangular.register(Curvature)
@lx.is_upper_triangular.register(Curvature)
def _(operator):
    # Diagonal where every block is (`Diagonal()`): `lx.Diagonal()` then solves it.
    return all(lx.is_diagonal(block) for block in operator.stored.values())


def leaf_shapes(leaves: list) -> list:
    """The shape of each array leaf, and the type of any other (a model's
    activation function, say), for error messages: `jnp.shape` of a leaf that is
    not an array is an error in newer JAX."""
    return [
        jnp.shape(x) if eqx.is_array_like(x) else f"<{type(x).__name__}>"
        for x in leaves
    ]
