"""eqfisher's internals, for tests, benchmarks and advanced users.

Nothing here is covered by the API's stability promise: names may change between
minor versions. It exists so that tests and benchmarks need no private module
(as `equinox.internal` does for Equinox).
"""

from ._cli import main as main  # the `eqfisher` console script, with its argv
from ._curvature import (
    JOIN_ROWS_PER_COLUMN as JOIN_ROWS_PER_COLUMN,
    conv_patches as conv_patches,
    kronecker_factors as kronecker_factors,
    layer_inputs as layer_inputs,
    layer_outputs_vjp as layer_outputs_vjp,
    per_example_taps as per_example_taps,
    pooled_factors as pooled_factors,
)
from ._tracer import (
    MIXED as MIXED,
    AbstractLayerKind as AbstractLayerKind,
    LayerRecord as LayerRecord,
    LossProgram as LossProgram,
    Split as Split,
    StagedLoss as StagedLoss,
    detect as detect,
    jaxpr_labels as jaxpr_labels,
    split as split,
    stage_loss as stage_loss,
)


# Deprecated: the old names of `LossProgram`, `StagedLoss` and `stage_loss` ("trace"
# is the matrix trace, `Curvature.trace`); they will be removed.
ProcessedTrace = LossProgram
Traced = StagedLoss
trace = stage_loss
