"""Curvature blocks: the curvature of one layer, as a `lineax` linear operator.

Each block acts on a tuple of the layer's parameter leaves (e.g. `(weight, bias)`);
dense matrices use the `jax.flatten_util.ravel_pytree` order of that tuple.
"""

from ._base import AbstractBlock as AbstractBlock
from .diagonal import Diagonal as Diagonal
from .eigen_kronecker import (
    EigenKroneckerFactored as EigenKroneckerFactored,
    ekfac_from_kronecker as ekfac_from_kronecker,
)
from .full import Full as Full
from .kronecker import KroneckerFactored as KroneckerFactored
