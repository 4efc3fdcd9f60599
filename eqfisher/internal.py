"""eqfisher's internals, for tests, benchmarks and advanced users.

Nothing here is covered by the API's stability promise: names may change between
minor versions. It exists so that tests and benchmarks need no private module
(as `equinox.internal` does for Equinox).
"""

from ._cli import main as main  # the `eqfisher` console script, with its argv
from ._example_axes import MIXED as MIXED, jaxpr_labels as jaxpr_labels
from ._layers import LayerRecord as LayerRecord, detect as detect
from ._patches import conv_patches as conv_patches
from ._statistics import (
    kronecker_factors as kronecker_factors,
    layer_outputs_vjp as layer_outputs_vjp,
    per_example_taps as per_example_taps,
    pooled_factors as pooled_factors,
)
from ._tracing import (
    ProcessedTrace as ProcessedTrace,
    Split as Split,
    Traced as Traced,
    split as split,
    trace as trace,
)
