"""Curvature statistics: K-FAC factors from one forward and a stacked VJP (the
exact per-example vectors are in `_curvature/per_example.py`).

The modules, in the order a curvature uses them:

- `forward`: one forward of the whole batch and its VJP (`layer_outputs_vjp`),
  giving each layer's inputs (`LayerInputs`) and output cotangents; a layer that
  needs only each example's sums is read that way (`per_example_taps`).
- `inputs`: what the input factor A is for each layer kind, a type
  (`AbstractLayerInputs`) found from the kind by `layer_inputs`, a
  `functools.singledispatch` on the kind's type (the tracer does not import this
  package); the dense and embedding inputs; `unsupported` says why a layer has no
  Kronecker factors (a scale-and-shift layer's curvature is kept exact).
- `convolution`: a convolution's inputs, the patches of its input (`patches`:
  `conv_patches`), in chunks of examples when they would be too large at once.
- `factors`: one layer's A and G (`kronecker_factors`).
- `pooling`: a group's factors (`pooled_factors`): the uses of one weight pool,
  and the uses at every step of a kept scan are computed at once.

This face re-exports what the rest of eqfisher uses.
"""

from . import convolution as convolution  # registers the convolution's inputs
from .factors import (
    kronecker_factors as kronecker_factors,
    output_matrix as output_matrix,
)
from .forward import (
    LayerInputs as LayerInputs,
    LayerOutputsVjp as LayerOutputsVjp,
    example_axis_size as example_axis_size,
    layer_outputs_vjp as layer_outputs_vjp,
    per_example_taps as per_example_taps,
)
from .inputs import (
    JOIN_ROWS_PER_COLUMN as JOIN_ROWS_PER_COLUMN,
    layer_inputs as layer_inputs,
    location_count as location_count,
    unsupported as unsupported,
)
from .patches import conv_patches as conv_patches
from .pooling import (
    at_steps as at_steps,
    every_step as every_step,
    pooled_factors as pooled_factors,
    scan_uses as scan_uses,
)
