"""Layer kinds as types: `AbstractLayerKind`, and one final class per kind that
the matchers of `candidates` produce.

A kind carries what layer detection and the per-example rows need to know of it,
as class attributes. The curvature statistics of each kind (K-FAC's input factor)
are found from its type in `_curvature/statistics/inputs.py`, by
`functools.singledispatch`: the tracer does not import the curvature code.
"""

from typing import TYPE_CHECKING, Literal

import equinox as eqx


# To pyright, `AbstractClassVar` is `typing.ClassVar`, as equinox makes it; the alias
# is made here because pyright reads one only in the module that makes it (and would
# otherwise take the class variables below for arguments of `__init__`).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


LayerKindName = Literal["dense", "conv", "scale_and_shift", "embedding"]


class AbstractLayerKind(eqx.Module):
    """A kind of layer the tracer detects.

    **Class attributes:**

    - `name`: what `LayerInfo.kind` says, e.g. `"dense"`.
    - `takes_bias`: whether a parameter added to its output (after relayouts) is
      its bias.
    - `tieable`: whether the applications of one weight (tied weights) can pool
      their statistics into one Kronecker block.
    - `elementwise`: whether it scales or shifts its input elementwise, so that its
      input and output are laid out alike.
    """

    name: AbstractClassVar[LayerKindName]
    takes_bias: AbstractClassVar[bool]
    tieable: AbstractClassVar[bool]
    elementwise: AbstractClassVar[bool]


class DenseKind(AbstractLayerKind):
    """`x @ w`: a `dot_general` with a weight on one side, or a layer declared with
    `eqfisher.register_dense`."""

    name = "dense"
    takes_bias = True
    tieable = True
    elementwise = False


class ConvKind(AbstractLayerKind):
    """A convolution with a kernel parameter (`conv_general_dilated`)."""

    name = "conv"
    takes_bias = True
    tieable = True
    elementwise = False


class ScaleAndShiftKind(AbstractLayerKind):
    """`x * scale + shift` (either part alone) with parameters broadcast along
    locations: a normalisation's affine part."""

    name = "scale_and_shift"
    takes_bias = True
    tieable = False
    elementwise = True


class EmbeddingKind(AbstractLayerKind):
    """A gather of whole rows of a `(vocab, features)` table. A parameter added to
    its output is another layer (a positional embedding), not its bias.

    `drops`: whether an id outside the table adds to no row's derivative (every
    gather mode but `"clip"`: XLA's scatter skips the id), rather than to the
    nearest row's (`jnp.take(mode="clip")`, and `eqx.nn.Embedding` under
    `jax.vmap`). The input factor counts the rows the derivative reaches.
    """

    drops: bool = eqx.field(static=True, default=False)
    name = "embedding"
    takes_bias = False
    tieable = False
    elementwise = False
