"""eqfisher: curvature for Equinox models, as typed lineax operators."""

import os as _os

from . import (
    blocks as blocks,
    filters as filters,
    influence as influence,
    laplace as laplace,
    losses as losses,
    optim as optim,
    spectral as spectral,
    tracing as tracing,
)
from ._compat import hide_frames as _hide_frames
from ._config import (
    Config as Config,
    configure as configure,
    current_config as current_config,
)
from ._curvature import (
    EKFAC as EKFAC,
    GGN as GGN,
    KFAC as KFAC,
    AbstractEstimator as AbstractEstimator,
    AbstractExamples as AbstractExamples,
    AbstractKroneckerStructure as AbstractKroneckerStructure,
    AbstractStructure as AbstractStructure,
    BlockDiagonal as BlockDiagonal,
    BlockMemory as BlockMemory,
    Curvature as Curvature,
    Dense as Dense,
    Diagonal as Diagonal,
    EmpiricalFisher as EmpiricalFisher,
    FisherExact as FisherExact,
    FisherMC as FisherMC,
    Group as Group,
    IndependentExamples as IndependentExamples,
    InteractingExamples as InteractingExamples,
    MemoryEstimate as MemoryEstimate,
    Needs as Needs,
    PerLayer as PerLayer,
    Statistics as Statistics,
    curvature as curvature,
    dataset_curvature as dataset_curvature,
    memory_estimate as memory_estimate,
    value_grad_and_curvature as value_grad_and_curvature,
)
from ._products import (
    MatrixFreeOperator as MatrixFreeOperator,
    empirical_fisher_operator as empirical_fisher_operator,
    ggn_operator as ggn_operator,
    hessian_operator as hessian_operator,
    stop_hessian as stop_hessian,
)
from .losses import (
    register_loss as register_loss,
    sigmoid_cross_entropy as sigmoid_cross_entropy,
    softmax_cross_entropy as softmax_cross_entropy,
    squared_error as squared_error,
)
from .tracing import (
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


# What `from eqfisher import *` binds, and what `help(eqfisher)` lists.
__all__ = [
    "MatrixFreeOperator",
    "AbstractEstimator",
    "AbstractExamples",
    "AbstractKroneckerStructure",
    "AbstractStructure",
    "BlockDiagonal",
    "BlockMemory",
    "Config",
    "Curvature",
    "Dense",
    "Diagonal",
    "EKFAC",
    "EmpiricalFisher",
    "FisherExact",
    "FisherMC",
    "GGN",
    "Group",
    "IndependentExamples",
    "InteractingExamples",
    "KFAC",
    "LayerData",
    "LayerInfo",
    "LayerReport",
    "MemoryEstimate",
    "Needs",
    "PerLayer",
    "RegisteredLoss",
    "Statistics",
    "configure",
    "current_config",
    "curvature",
    "dataset_curvature",
    "empirical_fisher_operator",
    "find_layers",
    "ggn_operator",
    "hessian_operator",
    "layer_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
    "memory_estimate",
    "register_dense",
    "register_loss",
    "sigmoid_cross_entropy",
    "softmax_cross_entropy",
    "squared_error",
    "stop_hessian",
    "value_grad_and_curvature",
]


# Users' tracebacks show their own code, not eqfisher's frames (as Equinox does).
_hide_frames(_os.path.dirname(__file__))

__version__ = "0.1.0"
