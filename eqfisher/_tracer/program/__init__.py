"""A jaxpr flattened into one list of equations, and its interpreter.

Nested `jit`, `jax.checkpoint` and custom-derivative calls that carry parameters or
a loss tag are inlined, so that layers inside them are visible and can be perturbed.
A `scan` that reads parameters (stacked layers as `xs`, or shared weights as
consts) stays a scan, a `ScanNode` holding its flattened body: each step's slice of
a stacked leaf is a *unit*, a parameter of its own, and a variable of the body at
step `t` is a `StepVar`; the interpreter perturbs such variables through the scan's
`xs` and reads them back as its `ys`, so the program does not grow with the number
of steps. The scans it cannot keep (nested scans over stacked leaves, a parameter
in the carry, a loss registered inside) are unrolled, up to `Config.max_unroll`
steps. Every other equation (`relu`'s custom JVP, `cond`, longer scans, ...) stays
one opaque node evaluated as a whole, so its own derivative rules are kept.

The modules, in the order a jaxpr goes through them: `types` (the data types:
`Program`, `Node`, `ScanNode`, `PVar`, `Unit`, ...) → `flatten` (a closed jaxpr
into a `Program`) → `evaluate` (the interpreter: run a `Program`, perturbing and
reading variables through a `VarMap`). This face re-exports what the rest of the
tracer and the curvature code use.
"""

from .conv_layout import portable as portable
from .evaluate import (
    Evaluation as Evaluation,
    VarMap as VarMap,
    evaluate as evaluate,
    mean_over as mean_over,
    points as points,
)
from .flatten import flatten as flatten
from .types import (
    STRUCTURAL as STRUCTURAL,
    SYMBOLIC as SYMBOLIC,
    Atom as Atom,
    Const as Const,
    Node as Node,
    Origin as Origin,
    Program as Program,
    PVar as PVar,
    ScanNode as ScanNode,
    StepVar as StepVar,
    Unit as Unit,
    scan_nodes as scan_nodes,
    symbolic as symbolic,
)
