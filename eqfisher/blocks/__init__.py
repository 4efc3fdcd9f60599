"""Curvature blocks: the curvature of one layer, as a `lineax` linear operator.

Each block acts on a tuple of the layer's parameter leaves (e.g. `(weight, bias)`);
dense matrices use the `jax.flatten_util.ravel_pytree` order of that tuple.
"""

from ._base import AbstractBlock as AbstractBlock
from .diagonal import DiagonalBlock as DiagonalBlock
from .eigen_kronecker import (
    EigenKroneckerFactored as EigenKroneckerFactored,
    ekfac_from_kronecker as ekfac_from_kronecker,
)
from .full import Full as Full
from .kronecker import KroneckerFactored as KroneckerFactored


def __getattr__(name: str):
    # `Diagonal` was the block's name until 0.2; it clashed with the structure
    # `eqfisher.Diagonal`.
    if name == "Diagonal":
        import warnings

        warnings.warn(
            "`eqfisher.blocks.Diagonal` is now `eqfisher.blocks.DiagonalBlock` "
            "(`eqfisher.Diagonal` is the structure).",
            DeprecationWarning,
            stacklevel=2,
        )
        return DiagonalBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# What `from eqfisher.blocks import *` binds, and what `help(eqfisher.blocks)` lists.
__all__ = [
    "AbstractBlock",
    "DiagonalBlock",
    "EigenKroneckerFactored",
    "Full",
    "KroneckerFactored",
    "ekfac_from_kronecker",
]
