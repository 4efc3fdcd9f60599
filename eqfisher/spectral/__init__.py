"""Randomised and Krylov estimators over any curvature operator: traces, diagonals,
squared Frobenius norms, top eigenpairs and spectral densities.

Every function takes a square lineax operator over parameter PyTrees: a
`eqfisher.Curvature` of any structure, `eqfisher.ggn_operator`,
`eqfisher.hessian_operator`, `eqfisher.empirical_fisher_operator`, or a user's own.
Internally they work on flat vectors (the `jax.flatten_util.ravel_pytree` order of
the operand) and apply the operator to many vectors at once through `jax.vmap` of
its `mv`. Randomness comes from an explicit `key`; shapes are static, loops are
`lax` loops, so every function can be `jit`-ted and `vmap`-ped over keys.
"""

from ._density import (
    Quadrature as Quadrature,
    lanczos_quadrature as lanczos_quadrature,
    spectral_density as spectral_density,
)
from ._eigen import (
    extreme_eigenvalues as extreme_eigenvalues,
    top_eigenpairs as top_eigenpairs,
)
from ._norm import squared_frobenius_norm as squared_frobenius_norm
from ._trace import (
    AbstractTraceEstimator as AbstractTraceEstimator,
    Hutchinson as Hutchinson,
    HutchPlusPlus as HutchPlusPlus,
    XTrace as XTrace,
    diagonal as diagonal,
    trace as trace,
)


# What `from eqfisher.spectral import *` binds, and what `help(eqfisher.spectral)` lists.
__all__ = [
    "AbstractTraceEstimator",
    "HutchPlusPlus",
    "Hutchinson",
    "Quadrature",
    "XTrace",
    "diagonal",
    "extreme_eigenvalues",
    "lanczos_quadrature",
    "spectral_density",
    "squared_frobenius_norm",
    "top_eigenpairs",
    "trace",
]
