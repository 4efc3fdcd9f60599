"""The tracer, for code that builds on it: what eqfisher finds in a loss function,
and the products it differentiates at the layers and at the registered losses.

`loss_fn(model, batch)` is traced once per (model structure, batch shapes and
dtypes): its jaxpr is flattened, the registered losses (`eqfisher.losses`) are read
from their tags, and the layers are found from the equations, not from module
types (a `dot_general` with a parameter on one side, a convolution, a
scale-and-shift, an embedding's gather, or a layer declared with
[`register_dense`][eqfisher.register_dense]). Everything here works inside
`jax.jit`/`eqx.filter_jit`.

- What the tracer finds: [`find_layers`][eqfisher.find_layers], returning a
  [`LayerReport`][eqfisher.LayerReport] of [`LayerInfo`][eqfisher.LayerInfo]s.
- Per-layer primals and cotangents from one pass:
  [`layer_vjp`][eqfisher.layer_vjp], returning
  [`LayerData`][eqfisher.LayerData].
- Products at the registered losses' inputs, over the whole parameter PyTree:
  [`loss_tags_vjp`][eqfisher.loss_tags_vjp],
  [`loss_tags_jvp`][eqfisher.loss_tags_jvp] and
  [`loss_tags_hvp`][eqfisher.loss_tags_hvp], with the losses as
  [`RegisteredLoss`][eqfisher.RegisteredLoss]es.

Each name here is also at the top level (`eqfisher.find_layers` is
`eqfisher.tracing.find_layers`).
"""

from ._tracer import (
    LayerData as LayerData,
    LayerInfo as LayerInfo,
    LayerReport as LayerReport,
    RegisteredLoss as RegisteredLoss,
    find_layers as find_layers,
    layer_vjp as layer_vjp,
    loss_tags_hvp as loss_tags_hvp,
    loss_tags_jvp as loss_tags_jvp,
    loss_tags_vjp as loss_tags_vjp,
    register_dense as register_dense,
)


# What `from eqfisher.tracing import *` binds, and what `help(eqfisher.tracing)` lists.
__all__ = [
    "LayerData",
    "LayerInfo",
    "LayerReport",
    "RegisteredLoss",
    "find_layers",
    "layer_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
    "register_dense",
]
