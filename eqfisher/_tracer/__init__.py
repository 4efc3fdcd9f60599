"""The tracer: capture a loss function, find its layers, and differentiate it.

`loss_fn(model, batch)` is traced once per (model structure, batch shapes and dtypes)
into a `LossProgram`: the flattened jaxpr, its loss tags, and its layer records,
with the parameters known by their model paths. Everything here runs inside
`jax.jit`/`eqx.filter_jit`; staging is Python work done at JAX trace time only.

The data path through it:

- `capture`: `split` a model and batch into flat leaves, `stage_loss` (trace
  `loss_fn` on them) into a `LossProgram`; `StagedLoss` is a loss function with a
  cache of its `LossProgram`s.
  It runs the three packages below in turn:
- `program/`: the jaxpr flattened into one list of equations (`flatten`), and its
  interpreter (`evaluate`);
- `analyses/`: the trace-time analyses of that program (axis labels, how the
  returned value depends on the registered losses, where examples live);
- `layers/`: layer detection on the program (`graph` → `candidates` → `verdict` →
  `detect`), with `declare` the tag of a layer declared by `register_dense`.

Then what the rest of eqfisher calls on a `LossProgram`: `layer_functions`
(`find_layers`, `layer_vjp`), `loss_tags` (`loss_tags_vjp`, `loss_tags_jvp`,
`loss_tags_hvp`), returning the values in `results` (`RegisteredLoss`, `LayerData`,
`LayerReport`). The statistics and the `Curvature` are built from a `LossProgram` by
`eqfisher._curvature`; the public face of this package is `eqfisher.tracing`.

This face re-exports what the rest of eqfisher uses.
"""

from .analyses import (
    MIXED as MIXED,
    jaxpr_labels as jaxpr_labels,
    label_of as label_of,
    leaf_axes as leaf_axes,
    proven_labels as proven_labels,
    stops_mixed_gradients as stops_mixed_gradients,
)
from .capture import (
    LossProgram as LossProgram,
    Returns as Returns,
    Split as Split,
    StagedLoss as StagedLoss,
    calls_custom_vjp as calls_custom_vjp,
    refuse_complex as refuse_complex,
    split as split,
    stage_loss as stage_loss,
)
from .declare import register_dense as register_dense
from .layer_functions import find_layers as find_layers, layer_vjp as layer_vjp
from .layers import (
    AbstractLayerKind as AbstractLayerKind,
    ConvKind as ConvKind,
    DenseKind as DenseKind,
    EmbeddingKind as EmbeddingKind,
    LayerInfo as LayerInfo,
    LayerRecord as LayerRecord,
    ScaleAndShiftKind as ScaleAndShiftKind,
    detect as detect,
)
from .loss_tags import (
    loss_tags_hvp as loss_tags_hvp,
    loss_tags_jvp as loss_tags_jvp,
    loss_tags_vjp as loss_tags_vjp,
)
from .program import (
    Const as Const,
    PVar as PVar,
    StepVar as StepVar,
    VarMap as VarMap,
    mean_over as mean_over,
    points as points,
    portable as portable,
)
from .results import (
    LayerData as LayerData,
    LayerReport as LayerReport,
    RegisteredLoss as RegisteredLoss,
)
