"""Curvature structures: how the curvature matrix is approximated, one Module each.

| structure | dense / conv / embedding layer | scale-and-shift layer | leaf in no layer |
|---|---|---|---|
| `Dense()` | one `Full` block over every selected parameter | same | same |
| `BlockDiagonal()` | `Full` block per layer | `Full` | `Full` per leaf |
| `Diagonal()` | `DiagonalBlock` (exact diagonal) | `DiagonalBlock` | `DiagonalBlock` |
| `KFAC()` | `KroneckerFactored` | `DiagonalBlock` (exact) | `DiagonalBlock` (exact) |
| `EKFAC()` | `EigenKroneckerFactored` | `DiagonalBlock` (exact) | `DiagonalBlock` (exact) |
| `PerLayer(...)` | the structure whose filter selects the layer | same | same |

A structure carries its behaviour as three methods, called in this order by
`eqfisher.curvature`: `groups` (which parameters share a block), `needs` (which
statistics a block is built from) and `block` (the block, from those statistics).
Structures know no jaxpr: they see `Group`s and `Statistics`.

An embedding's K-FAC input factor is diagonal (token frequencies), stored densely.
"""

import abc
import dataclasses
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from . import filters
from ._layers import LayerInfo, LayerRecord
from .blocks import (
    AbstractBlock,
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
    ekfac_from_kronecker,
)
from .blocks._layout import to_matrix


GIB = 2**30


def matrix_gib(sizes: list[int], dtype) -> float:
    """GiB of a dense square matrix over parameters of these sizes (statistics
    are at least float32)."""
    n = sum(sizes)
    return n * n * max(jnp.dtype(dtype).itemsize, 4) / GIB


WeightSharing = Literal["expand", "reduce"]


@dataclasses.dataclass(frozen=True)
class Group:
    """The parameters of one block: a layer's selected leaves, a leaf in no layer, or
    a union of these (`Group.merge`).

    **Fields:**

    - `name`: the block's name in `Curvature.blocks` (the layer's model path, or a
      parameter path for a leaf in no layer).
    - `layer`: the `eqfisher.LayerInfo` of the layer, or None.
    - `paths`: the parameters' paths, in operand order.
    - `shapes`: the parameters as `jax.ShapeDtypeStruct`s: the block's operand.
    - `kronecker`: whether Kronecker factors can be computed (a dense, conv or
      embedding layer whose weight is selected).
    - `unsupported`: why a layer with a weight has no Kronecker factors (a phrase
      following its name), or None.

    The other fields are eqfisher's bookkeeping: parameter numbers, the layer
    applications, and which part of a `PerLayer` builds the block.

    !!! Example

        A structure receives one candidate `Group` per layer; merging them gives one
        dense block over everything, as `Dense()`:

        ```python
        class OneBlock(ef.AbstractStructure):
            def groups(self, candidates, model, caller):
                assert [g.name for g in candidates] == ["layers[0]", "layers[1]"]
                assert candidates[0].paths == (".layers[0].weight", ".layers[0].bias")
                assert candidates[0].kronecker  # a dense layer, its weight selected
                return (ef.Group.merge(candidates, "everything"),)

            def needs(self, group):
                return ef.Needs(examples=True)

            def block(self, group, statistics):
                return statistics.full()

        mine = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=OneBlock()
        )
        dense = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
        )
        assert list(mine.blocks) == ["everything"]
        assert jnp.allclose(mine.as_matrix(), dense.as_matrix(), atol=1e-6)
        ```
    """

    name: str
    layer: LayerInfo | None
    paths: tuple[str, ...]
    shapes: tuple[jax.ShapeDtypeStruct, ...]
    kronecker: bool
    unsupported: str | None
    leaves: tuple[int, ...]
    units: tuple[tuple[int, tuple[int, ...]], ...]
    records: tuple[LayerRecord, ...]
    route: tuple[int, ...] = ()

    @staticmethod
    def merge(groups: tuple["Group", ...], name: str) -> "Group":
        """One group over the parameters of `groups`, in model order, in no layer."""
        items = sorted(
            (u, i, p, s)
            for g in groups
            for u, i, p, s in zip(g.units, g.leaves, g.paths, g.shapes)
        )
        return Group(
            name=name,
            layer=None,
            paths=tuple(p for _, _, p, _ in items),
            shapes=tuple(s for _, _, _, s in items),
            kronecker=False,
            unsupported=None,
            leaves=tuple(i for _, i, _, _ in items),
            units=tuple(u for u, _, _, _ in items),
            records=(),
        )


class Needs(eqx.Module):
    """The statistics a structure builds one block from.

    **Fields:**

    - `kronecker`: K-FAC's factors A and G (only for a group with
      `Group.kronecker`).
    - `examples`: exact per-example vectors, whose outer products sum to the block.
    - `weight_sharing`: the K-FAC variant of the factors, `"expand"` or `"reduce"`
      (see `KFAC`).
    - `max_factor_dim`: `None`, or a size above which a factor is computed as its
      diagonal only (a vector in `Statistics`).

    !!! Example

        What the built-in structures ask for:

        ```python
        needs = ef.KFAC(weight_sharing="reduce").kronecker_needs()
        assert needs.kronecker and not needs.examples
        assert needs.weight_sharing == "reduce"
        assert ef.EKFAC().kronecker_needs().examples  # EKFAC's exact diagonal too
        ```
    """

    kronecker: bool = eqx.field(static=True, default=False)
    examples: bool = eqx.field(static=True, default=False)
    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")
    max_factor_dim: int | None = eqx.field(static=True, default=None)


class Statistics(eqx.Module):
    r"""What a structure receives to build one block: the statistics it asked for in
    `Needs` (the others are None), in at least float32.

    **Fields:**

    - `shapes`: static; the block's operand (its parameters, as
      `jax.ShapeDtypeStruct`s).
    - `a`, `g`: K-FAC's input factor A `(d_in', d_in')` (d_in' = d_in + 1 with a
      bias, its coordinate last) and output factor G `(d_out, d_out)`; a factor
      above `Needs.max_factor_dim` is its diagonal, a vector.
    - `weight_perm`: static; how the weight maps to its `(d_out, d_in)` matrix view
      (see `eqfisher.blocks.KroneckerFactored`).
    - `rows`: per operand leaf, the per-example vectors `(m, *leaf.shape)`: the
      curvature block is $\sum_i u_i u_i^\top$ over the ravelled rows $u_i$.

    !!! Example

        A K-FAC variant that builds its blocks from the factors itself, here with
        G doubled:

        ```python
        class DoubledG(ef.AbstractKroneckerStructure):
            weight_sharing: str = "expand"

            def kronecker_needs(self):
                return ef.Needs(kronecker=True)

            def kronecker_block(self, group, statistics):
                return ef.blocks.KroneckerFactored(
                    statistics.a,  # (d_in + 1, d_in + 1): the bias coordinate last
                    2 * statistics.g,  # (d_out, d_out)
                    weight_perm=statistics.weight_perm,
                    structure=statistics.shapes,
                )

        mine = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=DoubledG()
        )
        kfac = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        block = mine.blocks["layers[0]"]  # eqx.nn.Linear(4, 8)
        assert block.a.shape == (5, 5) and block.g.shape == (8, 8)
        assert jnp.allclose(block.g, 2 * kfac.blocks["layers[0]"].g)
        ```
    """

    shapes: tuple[jax.ShapeDtypeStruct, ...] = eqx.field(static=True)
    a: Float[Array, "d_in d_in"] | Float[Array, " d_in"] | None = None
    g: Float[Array, "d_out d_out"] | Float[Array, " d_out"] | None = None
    weight_perm: tuple[int, ...] | None = eqx.field(static=True, default=None)
    rows: tuple[Float[Array, "m ..."], ...] | None = None

    def _rows(self, method: str) -> tuple[Array, ...]:
        if self.rows is None:
            raise ValueError(
                f"`Statistics.{method}()` needs per-example vectors: return "
                "`eqfisher.Needs(examples=True)` from the structure's `needs`."
            )
        return self.rows

    def _factors(self, method: str) -> tuple[Array, Array]:
        if self.a is None or self.g is None:
            raise ValueError(
                f"`Statistics.{method}()` needs Kronecker factors: return "
                "`eqfisher.Needs(kronecker=True)` from the structure's `needs` "
                "(for a group with `Group.kronecker`)."
            )
        return self.a, self.g

    def full(self) -> Full:
        """The exact block, dense, from the per-example vectors."""
        rows = self._rows("full")
        m = jnp.concatenate([r.reshape(r.shape[0], -1) for r in rows], axis=1)
        return Full(m.T @ m, self.shapes)

    def diagonal(self) -> DiagonalBlock:
        """The exact diagonal of the block, from the per-example vectors."""
        return DiagonalBlock(
            tuple(jnp.sum(r**2, axis=0) for r in self._rows("diagonal"))
        )

    def kronecker(self) -> KroneckerFactored:
        r"""The K-FAC block $G \otimes A$ (a vector factor is diagonal)."""
        a, g = self._factors("kronecker")
        return KroneckerFactored(
            a, g, weight_perm=self.weight_perm, structure=self.shapes
        )

    def eigen_kronecker(self) -> EigenKroneckerFactored:
        """The EKFAC block: K-FAC's eigenbases with the exact diagonal of the block in
        that basis (from the per-example vectors)."""
        rows = self._rows("eigen_kronecker")
        d_out = self._factors("eigen_kronecker")[1].shape[0]
        mats = jax.vmap(lambda *v: to_matrix(v, self.weight_perm, d_out))(*rows)
        return ekfac_from_kronecker(self.kronecker(), mats)


class AbstractStructure(eqx.Module):
    """How the curvature is approximated.

    A structure implements three methods, which `eqfisher.curvature` calls in turn:

    - `groups(candidates, model, caller)`: the blocks, as `Group`s, given one
      candidate group per layer (its selected leaves) and per selected leaf in no
      layer. Return `candidates` for one block per layer; merge them with
      `Group.merge`.
    - `needs(group)`: the `Needs` of one block.
    - `block(group, statistics)`: the block, an `eqfisher.blocks.AbstractBlock` on
      the operand `group.shapes`, from the `Statistics` asked for.

    !!! Example

        The exact diagonal, one block per layer (what `Diagonal()` does):

        ```python
        class MyDiagonal(ef.AbstractStructure):
            def groups(self, candidates, model, caller):
                return candidates  # one block per layer

            def needs(self, group):
                return ef.Needs(examples=True)  # the per-example vectors

            def block(self, group, statistics):
                return statistics.diagonal()

        mine = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=MyDiagonal()
        )
        exact = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
        )
        assert jnp.allclose(
            jnp.diag(mine.as_matrix()), jnp.diag(exact.as_matrix()), atol=1e-6
        )
        ```
    """

    @abc.abstractmethod
    def groups(
        self, candidates: tuple[Group, ...], model: PyTree, caller: str
    ) -> tuple[Group, ...]:
        """The blocks over the `candidates` (one per layer and per leaf in no layer).

        **Arguments:**

        - `candidates`: the candidate groups, in model order.
        - `model`: the model the curvature is computed for (for filters).
        - `caller`: the public function called, for error messages.

        **Returns:**

        A tuple of `Group`s covering each candidate's parameters exactly once.
        """

    @abc.abstractmethod
    def needs(self, group: Group) -> Needs:
        """The statistics the block over `group` is built from."""

    @abc.abstractmethod
    def block(self, group: Group, statistics: Statistics) -> AbstractBlock:
        """The block over `group`, from the `statistics` that `needs` asked for."""


class Dense(AbstractStructure):
    """One dense matrix over all selected parameters (small models only).

    **Arguments:**

    - `max_gib`: the largest matrix, in GiB, that `Dense()` builds (default 1); a
      larger one raises a `ValueError` giving its size.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
        print(list(curv.blocks))  # ['all']: one block over all 67 parameters
        ```
    """

    max_gib: float = eqx.field(static=True, default=1.0)

    def groups(self, candidates, model, caller):
        merged = Group.merge(candidates, "all")
        sizes = [math.prod(s.shape) for s in merged.shapes]
        gib = matrix_gib(sizes, jnp.result_type(*[s.dtype for s in merged.shapes]))
        if gib > self.max_gib:
            raise ValueError(
                f"`{caller}(..., structure=eqfisher.Dense())`: the dense matrix over "
                f"{sum(sizes):,} parameters would take {gib:.2f} GiB, above "
                f"`max_gib` = {self.max_gib}. Use structure=eqfisher.KFAC(), "
                "BlockDiagonal() or Diagonal(), select fewer parameters with "
                "`where=`, use the matrix-free eqfisher.ggn_operator, or raise the "
                "limit with eqfisher.Dense(max_gib=...)."
            )
        return (merged,)

    def needs(self, group):
        return Needs(examples=True)

    def block(self, group, statistics):
        return statistics.full()


class _AbstractExactPerLayer(AbstractStructure):
    """A block per candidate (per layer, and per leaf in no layer), built from the
    exact per-example vectors; subclasses implement `block`."""

    def groups(self, candidates, model, caller):
        return candidates

    def needs(self, group):
        return Needs(examples=True)


class BlockDiagonal(_AbstractExactPerLayer):
    """A dense block per layer; leaves in no layer get their own dense block.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.BlockDiagonal()
        )
        print({name: b.as_matrix().shape for name, b in curv.blocks.items()})
        ```
    """

    def block(self, group, statistics):
        return statistics.full()


class Diagonal(_AbstractExactPerLayer):
    """The exact diagonal of the curvature.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Diagonal())
        diag = curv.diagonal()  # a PyTree like the parameters, e.g. EWC's weights
        ```
    """

    def block(self, group, statistics):
        return statistics.diagonal()


class AbstractKroneckerStructure(AbstractStructure):
    """Kronecker-factored blocks for the layers that have Kronecker factors, and
    the exact diagonal for every other parameter (scale-and-shift layers, leaves in
    no layer, a layer whose weight is not selected).

    Subclasses set `weight_sharing` and implement `kronecker_needs` and
    `kronecker_block`.

    !!! Example

        K-FAC itself, as the smallest subclass:

        ```python
        class MyKFAC(ef.AbstractKroneckerStructure):
            weight_sharing: str = "expand"

            def kronecker_needs(self):
                return ef.Needs(kronecker=True, weight_sharing=self.weight_sharing)

            def kronecker_block(self, group, statistics):
                return statistics.kronecker()  # G ⊗ A

        mine = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=MyKFAC()
        )
        kfac = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        assert isinstance(mine.blocks["layers[1]"], ef.blocks.KroneckerFactored)
        assert jnp.allclose(mine.as_matrix(), kfac.as_matrix(), atol=1e-6)
        ```
    """

    weight_sharing: eqx.AbstractVar[WeightSharing]

    def __check_init__(self):
        if self.weight_sharing not in ("expand", "reduce"):
            raise ValueError(
                f"`eqfisher.{type(self).__name__}(weight_sharing=...)`: expected "
                f"'expand' or 'reduce', got {self.weight_sharing!r}."
            )

    def groups(self, candidates, model, caller):
        for g in candidates:
            if g.unsupported is not None:
                raise ValueError(
                    f"`{caller}(..., structure={self!r})`: layer `{g.name}` "
                    f"{g.unsupported}. Exclude it with `where=` (e.g. "
                    f"`~eqfisher.filters.by_path('{g.name}.*')`), give it another "
                    "structure with eqfisher.PerLayer, or use "
                    "structure=eqfisher.Diagonal()."
                )
        return candidates

    @abc.abstractmethod
    def kronecker_needs(self) -> Needs:
        """The statistics of a layer with Kronecker factors."""

    @abc.abstractmethod
    def kronecker_block(self, group: Group, statistics: Statistics) -> AbstractBlock:
        """The block of a layer with Kronecker factors."""

    def needs(self, group):
        return self.kronecker_needs() if group.kronecker else Needs(examples=True)

    def block(self, group, statistics):
        if group.kronecker:
            return self.kronecker_block(group, statistics)
        return statistics.diagonal()


class KFAC(AbstractKroneckerStructure):
    r"""Kronecker-factored blocks for dense, conv and embedding layers (K-FAC).

    $A$ is the mean over locations of $\tilde a \tilde a^\top$ ($\tilde a = [a; 1]$
    with a bias), $G$ the sum over locations of $g g^\top$, $g$ the output cotangents
    of the loss-weighted output vectors; for one example $G \otimes A$ is the exact
    block (on the row-major vec of the `(out, in)` weight matrix).

    **Arguments:**

    - `weight_sharing`: for layers applied at several locations per example
      (sequence positions, conv patches), the variant of Eschenhagen et al.
      (NeurIPS 2023). `"expand"` treats every location as an example; `"reduce"`
      first averages the inputs and sums the output cotangents over each example's
      locations. They coincide when each example has one location. The example axis
      is the first location axis of the layer (the batch axis under `jax.vmap`).
    - `max_factor_dim`: `None` (default), or a size above which a factor (A or G)
      is kept diagonal: its diagonal, stored as a vector, as kfac_jax does for
      large embeddings and output layers. Memory and solves are then linear in that
      factor's size.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        block = curv.blocks["layers[0]"]  # an eqfisher.blocks.KroneckerFactored
        print(block.a.shape, block.g.shape)  # (5, 5) (8, 8): 4 inputs and a bias, 8 outputs
        ```
    """

    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")
    max_factor_dim: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        m = self.max_factor_dim
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(
                "`eqfisher.KFAC(max_factor_dim=...)`: expected None or a positive "
                f"int, got {m!r}."
            )

    def kronecker_needs(self):
        return Needs(
            kronecker=True,
            weight_sharing=self.weight_sharing,
            max_factor_dim=self.max_factor_dim,
        )

    def kronecker_block(self, group, statistics):
        return statistics.kronecker()


class EKFAC(AbstractKroneckerStructure):
    """K-FAC eigenbases with the exact diagonal of the curvature in that basis.

    **Arguments:**

    - `weight_sharing`: the K-FAC variant whose eigenbases are used (see `KFAC`).

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.EKFAC())
        step = curv.solve(grads, 1e-3)
        ```
    """

    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")

    def kronecker_needs(self):
        return Needs(kronecker=True, examples=True, weight_sharing=self.weight_sharing)

    def kronecker_block(self, group, statistics):
        return statistics.eigen_kronecker()


def _leaf_mask(model: PyTree, where, caller: str, part: int) -> list[bool]:
    """Per parameter leaf of `model`, whether `where` selects it."""
    leaves = jax.tree_util.tree_leaves(model)
    try:
        flags = jax.tree_util.tree_leaves(filters.mask(model, where))
    except ValueError as e:
        raise ValueError(
            f"`{caller}(..., structure=eqfisher.PerLayer(...))`: part {part}: {e}"
        ) from None
    return [f for f, x in zip(flags, leaves) if eqx.is_inexact_array(x)]


class PerLayer(AbstractStructure):
    """Different structures for different layers, chosen with filters.

    ```python
    structure = ef.PerLayer(
        (ef.filters.by_path("layers[1].*"), ef.Diagonal()),  # the output layer
        default=ef.KFAC(),
    )
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    assert isinstance(curv.blocks["layers[0]"], ef.blocks.KroneckerFactored)
    assert isinstance(curv.blocks["layers[1]"], ef.blocks.DiagonalBlock)
    ```

    Each layer (and each leaf in no layer) takes the structure of the first part
    whose filter selects its parameters, else `default`. A layer's parameters must
    all go to one part (select whole layers, e.g. `by_path("head.*")`). Each part
    groups its own layers: a `Dense()` part is one block over its layers, named
    `"all"` (so at most one part may be `Dense()`).

    **Arguments:**

    - `*parts`: `(where, structure)` pairs; `where` is an `eqfisher.filters` filter
      or an Equinox filter spec (as for `where=` of `eqfisher.curvature`).
    - `default`: the structure of the parameters no part selects.
    """

    parts: tuple[tuple[object, AbstractStructure], ...]
    default: AbstractStructure

    def __init__(self, *parts: tuple[object, AbstractStructure], default):
        self.parts = tuple(tuple(p) for p in parts)
        self.default = default

    def __check_init__(self):
        for i, part in enumerate(self.parts):
            if len(part) != 2 or not isinstance(part[1], AbstractStructure):
                raise TypeError(
                    f"`eqfisher.PerLayer(*parts, default=...)`: part {i} must be a "
                    "pair `(where, structure)` with a structure such as "
                    f"eqfisher.Diagonal(), got {part!r}."
                )
        if not isinstance(self.default, AbstractStructure):
            raise TypeError(
                "`eqfisher.PerLayer(*parts, default=...)`: `default` must be a "
                f"structure such as eqfisher.KFAC(), got {self.default!r}."
            )

    def _structures(self) -> tuple[AbstractStructure, ...]:
        return tuple(s for _, s in self.parts) + (self.default,)

    def groups(self, candidates, model, caller):
        masks = [_leaf_mask(model, w, caller, i) for i, (w, _) in enumerate(self.parts)]
        chosen: list[list[Group]] = [[] for _ in self._structures()]
        for g in candidates:
            parts = {
                next((k for k, m in enumerate(masks) if m[leaf]), len(masks))
                for leaf, _ in g.units
            }
            if len(parts) != 1:
                raise ValueError(
                    f"`{caller}(..., structure=eqfisher.PerLayer(...))`: the "
                    f"parameters of `{g.name}` ({', '.join(g.paths)}) go to "
                    f"different parts {sorted(parts)}; a block's parameters need "
                    f"one structure. Select whole layers, e.g. "
                    f"`eqfisher.filters.by_path('{g.name}.*')`."
                )
            chosen[parts.pop()].append(g)
        out = []
        for k, (structure, part) in enumerate(zip(self._structures(), chosen)):
            if part:
                out += [
                    dataclasses.replace(g, route=(k,) + g.route)
                    for g in structure.groups(tuple(part), model, caller)
                ]
        names = [g.name for g in out]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(
                f"`{caller}(..., structure=eqfisher.PerLayer(...))`: two parts "
                f"build blocks named {twice}; use at most one `Dense()` part."
            )
        return tuple(out)

    def _part(self, group: Group) -> tuple[AbstractStructure, Group]:
        k = group.route[0]
        return self._structures()[k], dataclasses.replace(group, route=group.route[1:])

    def needs(self, group):
        structure, group = self._part(group)
        return structure.needs(group)

    def block(self, group, statistics):
        structure, group = self._part(group)
        return structure.block(group, statistics)


def candidates(processed, selected: list[int], unsupported) -> tuple[Group, ...]:
    """One group per layer over its selected parameters, and one per selected
    parameter in no layer, in model order.

    `processed` is a `ProcessedTrace`, `selected` the selected leaves, and
    `unsupported(record)` says why a layer has no Kronecker factors (or None).
    Parameter numbers are `ProcessedTrace.units`: whole leaves, or, for a stacked
    leaf read by a scan, its per-step units.
    """
    parts = processed.parts(selected)
    chosen = set(parts)
    avals = [v.aval for v in processed.program.invars]

    def shape(i):
        leaf, index = processed.units[i]
        aval = avals[leaf]
        return jax.ShapeDtypeStruct(aval.shape[len(index) :], aval.dtype)

    def group(name, layer, leaves, records, kronecker, reason):
        return Group(
            name=name,
            layer=layer,
            paths=tuple(processed.paths[i] for i in leaves),
            shapes=tuple(shape(i) for i in leaves),
            kronecker=kronecker,
            unsupported=reason,
            leaves=leaves,
            units=tuple(processed.units[i] for i in leaves),
            records=records,
        )

    applications: dict[tuple[int, ...], list[LayerRecord]] = {}
    for r in processed.layers:
        applications.setdefault(r.param_indices, []).append(r)
    out, covered = [], set()
    for indices, records in applications.items():
        r = records[0]
        leaves = tuple(i for i in indices if i in chosen)
        if not leaves:
            continue
        covered.update(leaves)
        reason = unsupported(r)
        weight_in = r.weight_perm is not None and indices[0] in chosen
        kron = weight_in and reason is None
        # A layer without a weight (scale-and-shift) is not refused, only diagonal.
        refused = reason if weight_in and r.weight_perm is not None else None
        out.append(group(r.info.name, r.info, leaves, tuple(records), kron, refused))
    for i in parts:
        if i not in covered:
            out.append(
                group(processed.paths[i].lstrip("."), None, (i,), (), False, None)
            )
    out.sort(key=lambda g: min(processed.units[i] for i in g.leaves))
    return tuple(out)


def check_groups(
    structure: AbstractStructure, groups, candidates: tuple[Group, ...], caller: str
) -> tuple[Group, ...]:
    """Checks that a structure's `groups` cover each candidate parameter once."""
    if not isinstance(groups, tuple) or not all(isinstance(g, Group) for g in groups):
        raise TypeError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            f".groups` must return a tuple of `eqfisher.Group`s, got {groups!r}."
        )
    want = sorted(i for g in candidates for i in g.leaves)
    got = sorted(i for g in groups for i in g.leaves)
    if got != want:
        raise ValueError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            ".groups` must cover every candidate parameter exactly once."
        )
    return tuple(groups)
