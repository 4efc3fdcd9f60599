"""What a curvature structure is: `AbstractStructure` and the values it works
with, `Group` (the parameters of one block), `Needs` (the statistics a block is
built from) and `Statistics` (those statistics, with the blocks they give).
"""

import abc
import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ..._refusal import int_hint
from ..._tracer import LayerInfo, LayerRecord
from ...blocks import (
    AbstractBlock,
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
    ekfac_from_kronecker,
)
from ...blocks._layout import from_matrix, to_matrix


# To pyright, `AbstractClassVar` is `typing.ClassVar`, as equinox makes it; the alias
# is made here because pyright reads one only in the module that makes it (and would
# otherwise take the class variables below for arguments of `__init__`).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


GIB = 2**30


def check_weight_sharing(call: str, weight_sharing: Any) -> None:
    """Refuses a K-FAC variant other than "expand" and "reduce" (a typo computed
    "expand"'s factors)."""
    if weight_sharing not in ("expand", "reduce"):
        raise ValueError(
            f"`{call}(weight_sharing=...)`: expected 'expand' or 'reduce', got "
            f"{weight_sharing!r}."
        )


def check_max_factor_dim(call: str, max_factor_dim: Any) -> None:
    """Refuses a `max_factor_dim` that is not None or a positive int."""
    m = max_factor_dim
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
        raise ValueError(
            f"`{call}(max_factor_dim=...)`: expected None or a positive int, got "
            f"{m!r}{int_hint(m)}."
        )


def check_gib(call: str, max_gib: Any) -> None:
    """Refuses a `max_gib` that is not a positive finite number (NaN turned the
    memory guard off, a string failed in a comparison)."""
    ok = isinstance(max_gib, numbers.Real) and not isinstance(max_gib, bool)
    if not (ok and math.isfinite(float(max_gib)) and float(max_gib) > 0):
        raise ValueError(
            f"`{call}(max_gib=...)`: a positive number of GiB, got {max_gib!r}."
        )


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
    - `param_indices`: the parameters' numbers, in operand order. eqfisher numbers
      the model's parameter leaves, then the per-step slices of a stacked leaf that
      a scan reads; `LayerRecord.param_indices` uses the same numbers.

    The other fields are eqfisher's bookkeeping: each parameter's `(leaf, index)`
    (`units`, `index == ()` for a whole leaf), the layer applications (`records`),
    and which part of a `PerLayer` builds the block (`route`).

    !!! Example

        A structure receives one candidate `Group` per layer; merging them gives one
        dense block over everything, as `Dense()`:

        ```python
        class OneBlock(ef.AbstractStructure):
            steps_alike = False

            def groups(self, candidates, model):
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
    param_indices: tuple[int, ...]
    units: tuple[tuple[int, tuple[int, ...]], ...]
    records: tuple[LayerRecord, ...]
    route: tuple[int, ...] = ()

    @staticmethod
    def merge(groups: tuple["Group", ...], name: str) -> "Group":
        """One group over the parameters of `groups`, in model order, in no layer."""
        items = sorted(
            (u, i, p, s)
            for g in groups
            for u, i, p, s in zip(g.units, g.param_indices, g.paths, g.shapes)
        )
        return Group(
            name=name,
            layer=None,
            paths=tuple(p for _, _, p, _ in items),
            shapes=tuple(s for _, _, _, s in items),
            kronecker=False,
            unsupported=None,
            param_indices=tuple(i for _, i, _, _ in items),
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

    def __check_init__(self):
        check_weight_sharing("eqfisher.Needs", self.weight_sharing)
        check_max_factor_dim("eqfisher.Needs", self.max_factor_dim)


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
    - `outer`: for a dense layer applied once to each example, the same vectors
      as outer products, `(ã, c)`: each example's input row `(N, d_in')` (with a
      bias, a 1 last) and its output cotangents `(N, K, d_out)`; example n's
      vectors are $c_{nk} \tilde a_n^\top$ in the weight's matrix view (see
      `weight_perm`). `diagonal` and `eigen_kronecker` then need only products
      of these, not the N·K formed `rows`. None for other layers.

    !!! Example

        A K-FAC variant that builds its blocks from the factors itself, here with
        G doubled:

        ```python
        class DoubledG(ef.AbstractKroneckerStructure):
            weight_sharing: str = "expand"
            steps_alike = True

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
    outer: tuple[Float[Array, "n d_in"], Float[Array, "n k d_out"]] | None = None

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
        if self.outer is not None:
            # Σ_nk (c_nk ã_nᵀ)², elementwise: (Σ_k c_nk²)ᵀ ã_n², summed over n.
            a, c = self.outer
            assert self.weight_perm is not None  # set with `outer`
            matrix = jnp.sum(c**2, axis=1).T @ a**2
            return DiagonalBlock(from_matrix(matrix, self.weight_perm, self.shapes))
        return DiagonalBlock(
            tuple(jnp.sum(r**2, axis=0) for r in self._rows("diagonal"))
        )

    def kronecker(self) -> KroneckerFactored:
        r"""The K-FAC block $G \otimes A$ (a vector factor is diagonal)."""
        a, g = self._factors("kronecker")
        assert self.weight_perm is not None  # set with the factors
        return KroneckerFactored(
            a, g, weight_perm=self.weight_perm, structure=self.shapes
        )

    def eigen_kronecker(
        self, bases: KroneckerFactored | None = None
    ) -> EigenKroneckerFactored:
        """The EKFAC block: K-FAC's eigenbases with the exact diagonal of the block in
        that basis (from the per-example vectors).

        **Arguments:**

        - `bases`: `None` (the default) for the eigenbases of this batch's K-FAC
            block (`kronecker()`); or a `KroneckerFactored` block of the same layer
            whose eigenbases are used instead, as for EKFAC over several batches
            (`eqfisher.dataset_curvature`), where the factors come from all of them.
            Then only the per-example vectors are needed.
        """
        block = self.kronecker() if bases is None else self._bases(bases)
        if self.outer is not None:
            return self._eigen_kronecker_outer(self.outer, block)
        rows = self._rows("eigen_kronecker")
        perm, d_out = block.weight_perm, block.g.shape[0]
        mats = jax.vmap(lambda *v: to_matrix(v, perm, d_out))(*rows)
        return ekfac_from_kronecker(block, mats)

    def _bases(self, bases: KroneckerFactored) -> KroneckerFactored:
        """`bases`, checked to be a K-FAC block on this block's operand."""
        own = (self.weight_perm, [tuple(s.shape) for s in self.shapes])
        given = (
            bases.weight_perm if self.weight_perm is not None else None,
            [tuple(s.shape) for s in jax.tree_util.tree_leaves(bases.in_structure())],
        )
        if own != given:
            raise ValueError(
                "`Statistics.eigen_kronecker(bases=...)`: `bases` is a block on "
                f"parameters shaped {given[1]} (weight_perm {bases.weight_perm}); "
                f"this block's are {own[1]} (weight_perm {self.weight_perm}). Pass "
                "the K-FAC block of the same layer."
            )
        return bases

    def _eigen_kronecker_outer(
        self, outer: tuple[Array, Array], block: KroneckerFactored
    ) -> EigenKroneckerFactored:
        # The scales Σ_nk (Q_Gᵀ c_nk ã_nᵀ Q_A)², as `ekfac_from_kronecker` takes
        # them from formed vectors: (Σ_k (c_nk Q_G)²)ᵀ (ã_n Q_A)², summed over n.
        block = block.precompute()
        assert block.a_eig is not None and block.g_eig is not None
        q_a, q_g = block.a_eig[1], block.g_eig[1]
        a, c = (x.astype(q_a.dtype) for x in outer)
        scales = jnp.sum((c @ q_g) ** 2, axis=1).T @ (a @ q_a) ** 2
        return EigenKroneckerFactored(
            q_a, q_g, scales, weight_perm=block.weight_perm, structure=block.structure
        )


class AbstractStructure(eqx.Module):
    """How the curvature is approximated.

    A structure sets the class variable `steps_alike` (below) and implements three
    methods, which `eqfisher.curvature` calls in turn:

    - `groups(candidates, model)`: the blocks, as `Group`s, given one candidate
      group per layer (its selected leaves) and per selected leaf in no layer.
      Return `candidates` for one block per layer; merge them with `Group.merge`.
    - `needs(group)`: the `Needs` of one block.
    - `block(group, statistics)`: the block, an `eqfisher.blocks.AbstractBlock` on
      the operand `group.shapes`, from the `Statistics` asked for.

    !!! Example

        The exact diagonal, one block per layer (what `Diagonal()` does):

        ```python
        class MyDiagonal(ef.AbstractStructure):
            steps_alike = True  # `needs` and `block` read only `shapes`

            def groups(self, candidates, model):
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

    The class variable `steps_alike`: `True` says that the structure's `needs` and
    `block` read a group only through its `shapes` and `kronecker` (not its name or
    parameters): the blocks of a layer stacked with `eqx.filter_vmap` and applied
    by `lax.scan` (one per step) are then built at once, by `jax.vmap` over the
    steps' statistics, which compiles one batched computation instead of one per
    step. eqfisher's `KFAC`, `EKFAC`, `Diagonal` and `BlockDiagonal` set it to
    `True`; `Dense` and `PerLayer` to `False` (blocks built step by step), as a
    structure whose blocks depend on a group's name or parameters must.
    """

    steps_alike: AbstractClassVar[bool]

    @abc.abstractmethod
    def groups(self, candidates: tuple[Group, ...], model: PyTree) -> tuple[Group, ...]:
        """The blocks over the `candidates` (one per layer and per leaf in no layer).

        **Arguments:**

        - `candidates`: the candidate groups, in model order.
        - `model`: the model the curvature is computed for (for filters).

        **Returns:**

        A tuple of `Group`s covering each candidate's parameters exactly once.

        **Raises:**

        An error raised here reaches the user with a note naming the call
        (`eqfisher.curvature(..., structure=...)`): say what is wrong and how to
        fix it, in the structure's own words.
        """

    @abc.abstractmethod
    def needs(self, group: Group) -> Needs:
        """The statistics the block over `group` is built from."""

    @abc.abstractmethod
    def block(self, group: Group, statistics: Statistics) -> AbstractBlock:
        """The block over `group`, from the `statistics` that `needs` asked for."""

    def fixed_bases(
        self,
    ) -> "tuple[AbstractStructure, Callable[[dict[str, AbstractBlock]], AbstractStructure]] | None":
        """How `eqfisher.dataset_curvature` averages this structure over batches.

        `None` (the default): the blocks of the batches, averaged by their `ema`,
        are the blocks of the data set. A structure whose blocks are estimated in
        bases that must be the same for every batch (`EKFAC`, in K-FAC's
        eigenbases) returns `(first, then)` instead: `first` is the structure of
        those bases, averaged over all the batches first; `then(blocks)` maps that
        curvature's `Curvature.blocks` (precomputed, `AbstractBlock.precompute`)
        to the structure estimated in them, whose blocks then average by their
        `ema`. A structure that finds its bases by `group.name` sets
        `steps_alike = False` (a stacked layer's steps are then built one by one,
        each with its own name).
        """
        return None
