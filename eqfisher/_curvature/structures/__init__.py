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

The modules: `protocol` (`AbstractStructure` and what it sees and returns: `Group`,
`Needs`, `Statistics`), the structures in `exact` (`Dense`, `BlockDiagonal`,
`Diagonal`), `kronecker` (`KFAC`, `EKFAC`) and `per_layer` (`PerLayer`), and
`grouping`: the candidate groups the builder hands to a structure's `groups`, and
the check of the groups it returns.

An embedding's K-FAC input factor is diagonal (token frequencies), stored densely.
"""

from .exact import (
    BlockDiagonal as BlockDiagonal,
    Dense as Dense,
    Diagonal as Diagonal,
)
from .grouping import candidates as candidates, check_groups as check_groups
from .kronecker import (
    EKFAC as EKFAC,
    KFAC as KFAC,
    AbstractKroneckerStructure as AbstractKroneckerStructure,
)
from .per_layer import PerLayer as PerLayer
from .protocol import (
    GIB as GIB,
    AbstractStructure as AbstractStructure,
    Group as Group,
    Needs as Needs,
    Statistics as Statistics,
    WeightSharing as WeightSharing,
    check_gib as check_gib,
    matrix_gib as matrix_gib,
)
