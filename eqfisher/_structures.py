"""Curvature structures: how the curvature matrix is approximated, one Module each.

| structure | dense / conv / embedding layer | scale-and-shift layer | leaf in no layer |
|---|---|---|---|
| `Dense()` | one `Full` block over every selected parameter | same | same |
| `BlockDiagonal()` | `Full` block per layer | `Full` | `Full` per leaf |
| `Diagonal()` | `Diagonal` (exact diagonal) | `Diagonal` | `Diagonal` |
| `KFAC()` | `KroneckerFactored` | `Diagonal` (exact) | `Diagonal` (exact) |
| `EKFAC()` | `EigenKroneckerFactored` | `Diagonal` (exact) | `Diagonal` (exact) |

An embedding's K-FAC input factor is diagonal (token frequencies), stored densely.
"""

import dataclasses
import math
from typing import Literal

import equinox as eqx
import jax.numpy as jnp

from ._layers import LayerRecord
from ._tracing import ProcessedTrace


class AbstractStructure(eqx.Module):
    """How the curvature is approximated."""


GIB = 2**30


def matrix_gib(sizes: list[int], dtype) -> float:
    """GiB of a dense square matrix over parameters of these sizes (statistics
    are at least float32)."""
    n = sum(sizes)
    return n * n * max(jnp.dtype(dtype).itemsize, 4) / GIB


class Dense(AbstractStructure):
    """One dense matrix over all selected parameters (small models only).

    **Arguments:**

    - `max_gib`: the largest matrix, in GiB, that `Dense()` builds (default 1); a
      larger one raises a `ValueError` giving its size.
    """

    max_gib: float = eqx.field(static=True, default=1.0)


class BlockDiagonal(AbstractStructure):
    """A dense block per layer; leaves in no layer get their own dense block."""


class Diagonal(AbstractStructure):
    """The exact diagonal of the curvature."""


WeightSharing = Literal["expand", "reduce"]


def _check_sharing(structure) -> None:
    if structure.weight_sharing not in ("expand", "reduce"):
        raise ValueError(
            f"`eqfisher.{type(structure).__name__}(weight_sharing=...)`: expected "
            f"'expand' or 'reduce', got {structure.weight_sharing!r}."
        )


class KFAC(AbstractStructure):
    """Kronecker-factored blocks for dense, conv and embedding layers (K-FAC).

    A = mean over locations of ã ãᵀ (ã = [a; 1] with a bias), G = Σ over locations of
    g gᵀ, g the output cotangents of the loss-weighted output vectors; for one
    example A ⊗ G is the exact block.

    **Arguments:**

    - `weight_sharing`: for layers applied at several locations per example
      (sequence positions, conv patches), the variant of Eschenhagen et al.
      (NeurIPS 2023). `"expand"` treats every location as an example; `"reduce"`
      first averages the inputs and sums the output cotangents over each example's
      locations. They coincide when each example has one location. The example axis
      is the first location axis of the layer (the batch axis under `jax.vmap`).
    """

    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")

    def __check_init__(self):
        _check_sharing(self)


class EKFAC(AbstractStructure):
    """K-FAC eigenbases with the exact diagonal of the curvature in that basis.

    **Arguments:**

    - `weight_sharing`: the K-FAC variant whose eigenbases are used (see `KFAC`).
    """

    weight_sharing: WeightSharing = eqx.field(static=True, default="expand")

    def __check_init__(self):
        _check_sharing(self)


@dataclasses.dataclass(frozen=True)
class Group:
    """The parameter leaves of one block, and the layer applications they come from
    (several for tied weights, none for leaves in no layer)."""

    name: str
    leaves: tuple[int, ...]
    records: tuple[LayerRecord, ...]
    kronecker: bool
    ekfac: bool = False

    @property
    def record(self) -> LayerRecord:
        return self.records[0]

    @property
    def needs_examples(self) -> bool:
        """Whether the block needs exact per-example parameter vectors."""
        return not self.kronecker or self.ekfac


def groups(
    structure: AbstractStructure,
    processed: ProcessedTrace,
    selected: list[int],
    caller: str,
) -> list[Group]:
    """The blocks `structure` builds over the `selected` parameter leaves.

    `Group.leaves` are parameter numbers (`ProcessedTrace.units`): whole leaves, or,
    for a stacked leaf read by a scan, its per-step units.
    """
    if isinstance(structure, Dense):
        avals = [processed.program.invars[i].aval for i in selected]
        sizes = [math.prod(a.shape) for a in avals]
        gib = matrix_gib(sizes, jnp.result_type(*[a.dtype for a in avals]))
        if gib > structure.max_gib:
            raise ValueError(
                f"`{caller}(..., structure=eqfisher.Dense())`: the dense matrix over "
                f"{sum(sizes):,} parameters would take {gib:.2f} GiB, above "
                f"`max_gib` = {structure.max_gib}. Use structure=eqfisher.KFAC(), "
                "BlockDiagonal() or Diagonal(), select fewer parameters with "
                "`where=`, use the matrix-free eqfisher.ggn_operator, or raise the "
                "limit with eqfisher.Dense(max_gib=...)."
            )
        return [Group("all", tuple(selected), (), False)]
    selected = processed.parts(selected)
    chosen = set(selected)
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
        weight_in = r.weight_perm is not None and indices[0] in chosen
        kron = isinstance(structure, (KFAC, EKFAC)) and r.kind != "scale_and_shift"
        if kron and weight_in and r.kind == "conv":
            if r.core.params["feature_group_count"] != 1:
                raise ValueError(
                    f"`{caller}(..., structure={structure!r})`: layer `{r.info.name}` "
                    "is a grouped convolution, whose curvature is block-diagonal "
                    "over its groups; K-FAC does not support it yet. Exclude it "
                    "with `where=` (e.g. `~eqfisher.filters.by_path("
                    f"'{r.info.name}.*')`) or use structure=eqfisher.Diagonal()."
                )
        out.append(
            Group(
                r.info.name,
                leaves,
                tuple(records),
                kron and weight_in,
                isinstance(structure, EKFAC),
            )
        )
    for i in selected:
        if i not in covered:
            out.append(Group(processed.paths[i].lstrip("."), (i,), (), False))
    out.sort(key=lambda g: min(processed.units[i] for i in g.leaves))
    return out
