"""The curvature: from a `LossProgram` (`eqfisher._tracer`) to a `Curvature`, the
blocks of a whole model as one lineax operator, and the functions that build it
(`curvature`, `value_grad_and_curvature`, `dataset_curvature`).

The options a user passes are typed Modules: `estimators` (which matrix: `GGN`,
`FisherExact`, `FisherMC`, `EmpiricalFisher`; each turns a registered loss into
output vectors), `structures/` (how it is approximated: `Dense`, `BlockDiagonal`,
`Diagonal`, `KFAC`, `EKFAC`, `PerLayer`), and `examples` (how a batch's examples
relate inside `loss_fn`).

The data path: `functions` (`curvature`, `value_grad_and_curvature`) → `builder`
(checks the arguments, selects and groups the parameters as the structure asks,
and gathers each group's statistics) → `statistics/` (K-FAC factors from one
forward and a stacked VJP) and `per_example` (exact per-example vectors) → the
structure's blocks (`eqfisher.blocks`) → `operator` (`Curvature`). `memory`
estimates the bytes of the blocks from shapes alone.

This face re-exports what the rest of eqfisher uses.
"""

from .builder import check_examples as check_examples
from .dataset import dataset_curvature as dataset_curvature
from .estimators import (
    GGN as GGN,
    AbstractEstimator as AbstractEstimator,
    EmpiricalFisher as EmpiricalFisher,
    FisherExact as FisherExact,
    FisherMC as FisherMC,
)
from .examples import (
    AbstractExamples as AbstractExamples,
    IndependentExamples as IndependentExamples,
    InteractingExamples as InteractingExamples,
)
from .functions import (
    curvature as curvature,
    value_grad_and_curvature as value_grad_and_curvature,
    value_grad_then_curvature as value_grad_then_curvature,
)
from .memory import (
    BlockMemory as BlockMemory,
    MemoryEstimate as MemoryEstimate,
    memory_estimate as memory_estimate,
)
from .operator import Curvature as Curvature, leaf_shapes as leaf_shapes
from .statistics import (
    JOIN_ROWS_PER_COLUMN as JOIN_ROWS_PER_COLUMN,
    conv_patches as conv_patches,
    kronecker_factors as kronecker_factors,
    layer_inputs as layer_inputs,
    layer_outputs_vjp as layer_outputs_vjp,
    per_example_taps as per_example_taps,
    pooled_factors as pooled_factors,
)
from .structures import (
    EKFAC as EKFAC,
    KFAC as KFAC,
    AbstractKroneckerStructure as AbstractKroneckerStructure,
    AbstractStructure as AbstractStructure,
    BlockDiagonal as BlockDiagonal,
    Dense as Dense,
    Diagonal as Diagonal,
    Group as Group,
    Needs as Needs,
    PerLayer as PerLayer,
    Statistics as Statistics,
)
