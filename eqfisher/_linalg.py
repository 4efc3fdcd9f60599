"""The matrix factorisations eqfisher calls, safe on every supported jaxlib.

On jaxlib 0.10 a batched LAPACK call can hang the CPU thread pool
(`_compat.LAPACK_SPLITS_BATCHES` says why). There each function here runs a batch
one matrix at a time on the CPU, the batch given as leading axes or made by
`jax.vmap`, through `jax.lax.map`: a loop whose body makes one unbatched call, which
jaxlib runs on the calling thread. Other jaxlibs, and other platforms, get the plain
`jax.numpy` function. Derivatives are those of the plain function.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl

from . import _compat


def _over_leading_axes(op: Callable, ndim: int) -> Callable:
    """`op` on its arguments' last `ndim` axes, looped over their leading axes.

    The loop's body is one function for all calls (a `lax.scan` of it traced once),
    and `jax.vmap` of the loop is the loop over the new axis too: called eagerly
    inside a `vmap` (`Curvature.solve` on a stacked layer), a loop made afresh at
    each call was traced and compiled again at each call.
    """

    def body(carry, xs):
        return carry, looped(*xs)

    def looped(*args):
        batch = jnp.shape(args[0])[: jnp.ndim(args[0]) - ndim]
        if not batch:
            return one(*args)
        flat = [jnp.reshape(a, (-1, *jnp.shape(a)[len(batch) :])) for a in args]
        _, out = jax.lax.scan(body, (), flat)
        return jax.tree.map(lambda o: jnp.reshape(o, (*batch, *o.shape[1:])), out)

    @jax.custom_batching.custom_vmap
    def one(*args):
        return op(*args)

    @one.def_vmap
    def _(axis_size, in_batched, *args):
        # The batched arguments' new axis is the leading one.
        front = [
            a if batched else jnp.broadcast_to(a, (axis_size, *jnp.shape(a)))
            for a, batched in zip(args, in_batched)
        ]
        out = looped(*front)
        return out, jax.tree.map(lambda _: True, out)

    return looped


def one_matrix_at_a_time(op: Callable, ndim: int = 2) -> Callable:
    """`op`, a function of matrices, with batches looped on the CPU.

    Always the loop (used where `_compat.LAPACK_SPLITS_BATCHES` is set, and by the
    tests on every jaxlib). The arguments share their leading (batch) axes; the
    derivatives are those of `op` itself, whose loop `jax.vmap` does not make.
    """
    looped = _over_leading_axes(op, ndim)

    @jax.custom_jvp
    def safe(*args):
        return jax.lax.platform_dependent(*args, cpu=looped, default=op)

    @safe.defjvp
    def _(primals, tangents):
        return jax.jvp(op, primals, tangents)

    return safe


def _safe(op: Callable) -> Callable:
    looped = one_matrix_at_a_time(op)

    @functools.wraps(op)
    def call(*args):
        # Read when traced, so that a test can compare both paths in one process.
        return (looped if _compat.LAPACK_SPLITS_BATCHES else op)(*args)

    return call


# Each wrapped function takes its arrays alone: `custom_jvp` and `custom_vmap` bind
# every parameter of the signature, defaults (such as `UPLO="L"`) included.
def _cholesky(x: Any) -> Any:
    return jnp.linalg.cholesky(x)


def _eigvalsh(x: Any) -> Any:
    return jnp.linalg.eigvalsh(x)


def _cho_solve(factor: Any, b: Any) -> Any:
    return jsl.cho_solve((factor, True), b)


def _svd(x: Any) -> Any:
    return tuple(jnp.linalg.svd(x, full_matrices=False))


def _eigh(x: Any) -> Any:
    return tuple(jnp.linalg.eigh(x))


def _qr(x: Any) -> Any:
    return tuple(jnp.linalg.qr(x))


cholesky = _safe(_cholesky)
cho_solve = _safe(_cho_solve)  # (L Lᵀ)⁻¹ b for a lower Cholesky factor L
eigh = _safe(_eigh)
eigvalsh = _safe(_eigvalsh)
qr = _safe(_qr)  # reduced
svd = _safe(_svd)  # reduced


@jax.custom_jvp
def fallible_cholesky(x: Any) -> Any:
    """`cholesky(x)`, NaN where `x` is not positive definite, for a caller that
    falls back to another method there: its derivative is zero there, not NaN.
    (The plain Cholesky's derivative at a NaN factor is NaN, and reverse mode
    multiplies it by the zero cotangent the unused factor gets: NaN again.)"""
    return cholesky(x)


@fallible_cholesky.defjvp
def _(primals, tangents):
    (x,), (dx,) = primals, tangents
    factor = cholesky(x)
    ok = jnp.all(jnp.isfinite(factor), axis=(-2, -1), keepdims=True)
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    safe = jnp.where(ok, factor, eye)
    # dL = L Φ(L⁻¹ dX L⁻ᵀ), Φ the lower triangle with its diagonal halved.
    sym = (dx + jnp.swapaxes(dx, -1, -2)) / 2
    # (Plain triangular solves: linear in the tangent, and transposable.)
    solve = functools.partial(jsl.solve_triangular, safe, lower=True)
    inner = solve(jnp.swapaxes(solve(sym), -1, -2))
    dfactor = safe @ (jnp.tril(inner) * (1 - eye / 2))
    return factor, jnp.where(ok, dfactor, jnp.zeros_like(dfactor))
