"""The exact structures: `Dense` (one block over everything), `BlockDiagonal`
(a dense block per layer) and `Diagonal` (the exact diagonal)."""

import math

import equinox as eqx
import jax.numpy as jnp

from .protocol import AbstractStructure, Group, Needs, check_gib, matrix_gib


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

    max_gib: float | int = eqx.field(static=True, default=1.0)
    steps_alike = False

    def __check_init__(self):
        check_gib("eqfisher.Dense", self.max_gib)

    def groups(self, candidates, model):
        merged = Group.merge(candidates, "all")
        sizes = [math.prod(s.shape) for s in merged.shapes]
        gib = matrix_gib(sizes, jnp.result_type(*[s.dtype for s in merged.shapes]))
        if gib > self.max_gib:
            raise ValueError(
                f"`eqfisher.Dense()`: the dense matrix over "
                f"{sum(sizes):,} parameters would take {gib:.3g} GiB, above "
                f"`max_gib` = {self.max_gib}. Use structure=eqfisher.KFAC(), "
                "BlockDiagonal() or Diagonal() (`eqfisher.memory_estimate` gives "
                "their sizes without computing them), select fewer parameters with "
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

    def groups(self, candidates, model):
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

    steps_alike = True

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

    steps_alike = True

    def block(self, group, statistics):
        return statistics.diagonal()
