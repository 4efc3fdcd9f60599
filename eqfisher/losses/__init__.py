"""Loss registration: the loss functions users call, and the loss families behind them.

A registered loss does two things at once: it returns the scalar loss (the mean over
every leading axis of a per-example loss, or the mask-weighted mean) and it puts a
*loss tag* on its input. The tag is an identity primitive, invisible to values and to
every derivative, that marks for eqfisher's tracer which array the model outputs, which
loss family sits on top of it, the targets, and the per-example weights.
"""

from ._bernoulli import Bernoulli as Bernoulli
from ._categorical import Categorical as Categorical
from ._family import AbstractLossFamily as AbstractLossFamily
from ._functions import (
    sigmoid_cross_entropy as sigmoid_cross_entropy,
    softmax_cross_entropy as softmax_cross_entropy,
    squared_error as squared_error,
)
from ._gaussian import Gaussian as Gaussian
from ._register import register_loss as register_loss
from ._tags import loss_tag_p as loss_tag_p, loss_value_tag_p as loss_value_tag_p


# The tag primitives are for eqfisher's tracer, not part of the API.
__all__ = [
    "AbstractLossFamily",
    "Bernoulli",
    "Categorical",
    "Gaussian",
    "register_loss",
    "sigmoid_cross_entropy",
    "softmax_cross_entropy",
    "squared_error",
]
