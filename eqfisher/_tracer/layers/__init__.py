"""Layer detection on a flattened program: which equations are layers, of which
kind, and why a parameter is in none.

Detection works on equations, not on module types, and runs as a chain of
functions from values to values, one module each:

`graph` (`Graph.of`: facts about the program: parameter views through structural
equations, consumers, what reaches a registered loss) → `candidates` (one
`Candidate` per layer-shaped equation, with its bias) → `verdict` (`judge`: which
candidates cannot be a Kronecker-factored layer, and why) → `detect` (the kept
layers as `LayerRecord`s in model order, and a reason for every parameter in none).

`detect` is what the tracer calls (`capture.stage_loss`); `LayerInfo` is what a user
sees of a layer, `LayerRecord` what the curvature code reads. A layer's kind is a
type (`kinds`: `AbstractLayerKind` and a final class per kind); `LayerInfo.kind` is
its name.
"""

from .detect import (
    Detection as Detection,
    LayerInfo as LayerInfo,
    LayerRecord as LayerRecord,
    detect as detect,
)
from .graph import sources as sources, unit_paths as unit_paths
from .kinds import (
    AbstractLayerKind as AbstractLayerKind,
    ConvKind as ConvKind,
    DenseKind as DenseKind,
    EmbeddingKind as EmbeddingKind,
    LayerKindName as LayerKindName,
    ScaleAndShiftKind as ScaleAndShiftKind,
)
