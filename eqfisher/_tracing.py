"""The tracing core: capture a loss function, find its layers, and differentiate it.

`loss_fn(model, batch)` is traced once per (model structure, batch shapes and dtypes)
into a `ProcessedTrace`: the flattened jaxpr, its loss tags, and its layer records,
with the parameters known by their model paths. Everything here runs inside
`jax.jit`/`eqx.filter_jit`; the trace is Python work done at JAX trace time only.

Where it lives: the values returned (`RegisteredLoss`, `LayerData`, `LayerReport`)
in `_tracing_results`, capture (`split`, `trace`, `ProcessedTrace`, `Traced`) in
`_tracing_capture`, `find_layers` and `layer_vjp` in `_tracing_layers`, the
products at the loss tags in `_tracing_loss_tags`; this module re-exports them.
"""

from ._tracing_capture import (
    ProcessedTrace as ProcessedTrace,
    Returns as Returns,
    Split as Split,
    Traced as Traced,
    split as split,
    trace as trace,
)
from ._tracing_layers import find_layers as find_layers, layer_vjp as layer_vjp
from ._tracing_loss_tags import (
    loss_tags_hvp as loss_tags_hvp,
    loss_tags_jvp as loss_tags_jvp,
    loss_tags_vjp as loss_tags_vjp,
)
from ._tracing_results import (
    LayerData as LayerData,
    LayerReport as LayerReport,
    RegisteredLoss as RegisteredLoss,
)
