"""The tracer's three trace-time analyses of a flattened program (`program`).

Each reads the program's equations once, at JAX trace time, and computes a label
per variable:

- `axes`: typed axis labels (`Location`, `Feature`, a leaf's axis) followed through
  structural equations; layer detection (`layers`) reads a parameter's views and a
  layer output's `(locations, features)` matrix layout from them.
- `objective`: how the value `loss_fn` returns depends on its registered losses;
  `check_objective` refuses a loss function whose value is not affine in them
  (`capture.stage_loss`).
- `example_axes`: where each variable keeps its examples; the curvature builder
  uses it to prove that the examples do not interact before the losses
  (`proven_labels`, `stops_mixed_gradients`).
"""

from .example_axes import (
    MIXED as MIXED,
    jaxpr_labels as jaxpr_labels,
    label_of as label_of,
    leaf_axes as leaf_axes,
    proven_labels as proven_labels,
    stops_mixed_gradients as stops_mixed_gradients,
)
from .objective import (
    check_objective as check_objective,
    control_flow_registrations as control_flow_registrations,
    inside_control_flow as inside_control_flow,
)
