"""The Kronecker-factored structures: `AbstractKroneckerStructure` and its
subclasses `KFAC` and `EKFAC`."""

import abc
import functools
from typing import cast

import equinox as eqx
import jax

from ... import filters
from ...blocks import AbstractBlock, KroneckerFactored
from .protocol import (
    AbstractStructure,
    Group,
    Needs,
    Statistics,
    WeightSharing,
    check_max_factor_dim,
    check_weight_sharing,
)


class AbstractKroneckerStructure(AbstractStructure):
    """Kronecker-factored blocks for the layers that have Kronecker factors, and
    the exact diagonal for every other parameter (scale-and-shift layers, leaves in
    no layer, a layer whose weight is not selected).

    Subclasses set `weight_sharing` and `steps_alike` (see `AbstractStructure`) and
    implement `kronecker_needs` and `kronecker_block`.

    !!! Example

        K-FAC itself, as the smallest subclass:

        ```python
        class MyKFAC(ef.AbstractKroneckerStructure):
            weight_sharing: str = "expand"
            steps_alike = True  # a block reads only the group's shapes

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
        check_weight_sharing(f"eqfisher.{type(self).__name__}", self.weight_sharing)

    def groups(self, candidates, model):
        for g in candidates:
            if g.unsupported is None:
                continue
            head = f"`{self!r}`: layer `{g.name}` "
            if len(candidates) == 1:
                raise ValueError(
                    f"{head}{g.unsupported}, and it holds every parameter selected. "
                    "Use another structure for it: structure=eqfisher.Diagonal(), "
                    "eqfisher.BlockDiagonal() or eqfisher.Dense()."
                )
            where = _selecting(g, model)
            raise ValueError(
                f"{head}{g.unsupported}. Exclude it with `where=~{where}`, give it "
                f"another structure with `structure=eqfisher.PerLayer(({where}, "
                f"eqfisher.Diagonal()), default={self!r})`, or use "
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


def _selecting(group: Group, model) -> str:
    """A filter, written out, that selects exactly the parameters of `group`: its
    name's `by_path('name.*')` where that is exact, else one `by_path` per path."""
    params = [
        p
        for p, x in jax.tree_util.tree_flatten_with_path(model)[0]
        if eqx.is_inexact_array(x)
    ]
    pattern = f"{group.name}.*"
    by_name = filters.by_path(pattern)
    chosen = {jax.tree_util.keystr(p) for p in params if by_name(p, None, ())}
    if chosen == set(group.paths):
        return f"eqfisher.filters.by_path({pattern!r})"
    each = [f"eqfisher.filters.by_path({p.removeprefix('.')!r})" for p in group.paths]
    return each[0] if len(each) == 1 else f"({' | '.join(each)})"


class KFAC(AbstractKroneckerStructure):
    r"""Kronecker-factored blocks for dense, conv and embedding layers (K-FAC).

    $A$ is the mean over locations of $\tilde a \tilde a^\top$ ($\tilde a = [a; 1]$
    with a bias), $G$ the sum over locations of $g g^\top$, $g$ the output cotangents
    of the loss-weighted output vectors; for one example of a layer applied at one
    location, $G \otimes A$ is the exact block (on the row-major vec of the
    `(out, in)` weight matrix).

    **Arguments:**

    - `weight_sharing`: for layers applied at several locations per example
      (sequence positions, conv patches), the variant of Eschenhagen et al.
      (NeurIPS 2023). `"expand"` treats every location as an example; `"reduce"`
      first averages the inputs and sums the output cotangents over each example's
      locations. They coincide when each example has one location. The example axis
      is the first location axis of the layer (the batch axis under `jax.vmap`):
      `"reduce"` refuses a batch whose examples lie along another axis
      (`examples=eqfisher.IndependentExamples(axis=1)`).
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
    steps_alike = True

    def __check_init__(self):
        check_max_factor_dim("eqfisher.KFAC", self.max_factor_dim)

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

    Where a factor has a repeated eigenvalue, its eigenbasis within that
    eigenspace is whichever `jnp.linalg.eigh` returns, and EKFAC can depend on
    it. With `"expand"` a factor's zero eigenspace (fewer rows than inputs) does
    not matter, since the curvature is zero there; with `"reduce"` it does (an
    example's gradient reaches beyond its mean input), so two EKFACs of the same
    data, computed differently (one batch, or `eqfisher.dataset_curvature`), can
    differ there, both valid.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.EKFAC())
        step = curv.solve(grads, 1e-3)
        ```
    """

    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")
    steps_alike = True

    def kronecker_needs(self):
        return Needs(kronecker=True, examples=True, weight_sharing=self.weight_sharing)

    def kronecker_block(self, group, statistics):
        return statistics.eigen_kronecker()

    def fixed_bases(self):
        # Averaged over batches, the scales of one batch's eigenbases would be mixed
        # with another's: K-FAC over all of them first, then the scales in its bases.
        return KFAC(weight_sharing=self.weight_sharing), functools.partial(
            _EKFACInBases, self.weight_sharing
        )


class _EKFACInBases(AbstractKroneckerStructure):
    """`EKFAC`'s scales in the eigenbases of given K-FAC blocks, by block name
    (`EKFAC.fixed_bases`): only the per-example vectors are computed."""

    weight_sharing: WeightSharing = eqx.field(static=True)
    bases: dict[str, AbstractBlock]
    steps_alike = False  # a block reads its group's name

    def __init__(self, weight_sharing: WeightSharing, blocks: dict[str, AbstractBlock]):
        self.weight_sharing = weight_sharing
        self.bases = blocks  # precomputed, or each batch decomposes its layer's

    def kronecker_needs(self):
        return Needs(examples=True, weight_sharing=self.weight_sharing)

    def kronecker_block(self, group, statistics):
        # A layer with Kronecker factors has a `KroneckerFactored` block in `KFAC`.
        bases = cast(KroneckerFactored, self.bases[group.name])
        return statistics.eigen_kronecker(bases=bases)
