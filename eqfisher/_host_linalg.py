"""Shifted inverses of PSD matrices computed on the host, by SciPy's LAPACK.

On the CPU, the K-FAC optimiser's refresh of its cached inverses
(`blocks.kronecker.shifted_inverses`) runs here, all of it in one
`jax.pure_callback`. XLA compiles the callback as one call. The same inverses
written in XLA (a batched Cholesky per size class, each with its
eigendecomposition fallback under a `lax.cond`) took a fifth to a third of a
K-FAC training step's first-call compile, and ran about as fast: it is the same
LAPACK (benchmarks/RESULTS.md, "Issue 26, eighth session")."""

import functools
from collections.abc import Sequence

import jax
import numpy as np
import scipy.linalg
from jaxtyping import Array


# LAPACK's inverse from a Cholesky factor (`potri`, then the upper triangle
# mirrored) takes less time than two triangular solves with the identity (`potrs`)
# from this size on; below it, more (0.20 against 0.16 ms at 129, 2.9 against 3.9
# ms at 513, float32).
POTRI_MIN_DIM = 384


def use_host(on_host: bool | None) -> bool:
    """Whether `shifted_inverses` is used: `on_host`, or where it is None, whether
    jax's default backend is the CPU (read when traced)."""
    return jax.default_backend() == "cpu" if on_host is None else on_host


def shifted_inverses(factors: Sequence[Array], shifts: Array) -> list[Array]:
    """`(factor + shift·I)⁻¹` of stacks of PSD matrices, `(k, d, d)` each, `shifts`
    the stacks' shifts one after another (`(Σk,)`), computed on the host in one
    callback: by Cholesky, or where
    that fails (float32 rounding) from the clamped eigendecomposition,
    `(clamp(F) + shift·I)⁻¹`. A matrix that is not finite, or whose
    eigendecomposition does not converge, gives NaN (the optimiser then keeps its
    last inverse). Not differentiable itself (`blocks.kronecker` differentiates
    it)."""
    shapes = [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in factors]
    return jax.pure_callback(
        _numpy_inverses, shapes, list(factors), shifts, vmap_method="sequential"
    )


def _numpy_inverses(factors, shifts) -> list[np.ndarray]:
    out, shifts = [], np.asarray(shifts)
    ends = np.cumsum([np.shape(stack)[0] for stack in factors])
    for stack, shift in zip(factors, np.split(shifts, ends[:-1])):
        stack = np.asarray(stack)
        # Half precisions are inverted in float32 (LAPACK has none below it).
        work = np.dtype(np.float64 if stack.dtype == np.float64 else np.float32)
        eye = np.eye(stack.shape[-1], dtype=work)
        inverses = np.empty(stack.shape, work)
        for i, (f, s) in enumerate(zip(stack.astype(work), shift.astype(work))):
            inverses[i] = _numpy_inverse(f, s, eye)
        out.append(inverses.astype(stack.dtype))
    return out


@functools.cache
def _lapack(dtype: np.dtype) -> tuple:
    return tuple(
        scipy.linalg.get_lapack_funcs(("potrf", "potrs", "potri"), dtype=dtype)
    )


def _numpy_inverse(
    factor: np.ndarray, shift: np.floating, eye: np.ndarray
) -> np.ndarray:
    if not np.all(np.isfinite(factor)):
        return np.full_like(factor, np.nan)
    potrf, potrs, potri = _lapack(factor.dtype)
    chol, info = potrf(factor + shift * eye, lower=1, clean=1, overwrite_a=1)
    if info == 0:
        if factor.shape[0] < POTRI_MIN_DIM:
            inverse, info = potrs(chol, eye, lower=1)
        else:
            lower, info = potri(chol, lower=1, overwrite_c=1)
            inverse = lower + np.tril(lower, -1).T
        if info == 0 and np.all(np.isfinite(inverse)):
            return inverse
    try:
        values, vectors = np.linalg.eigh(factor)
    except np.linalg.LinAlgError:  # did not converge
        return np.full_like(factor, np.nan)
    return (vectors / (np.maximum(values, 0) + shift)) @ vectors.T
