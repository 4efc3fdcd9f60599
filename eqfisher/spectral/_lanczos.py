"""The Lanczos iteration on a flattened symmetric operator, as `lax` loops."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _linalg as linalg
from ._flat import FlatOperator


def _unit(key: PRNGKeyArray, size: int, dtype) -> Float[Array, " size"]:
    v = jax.random.normal(key, (size,), dtype)
    return v / jnp.linalg.norm(v)


def lanczos_basis(
    operator: FlatOperator, iterations: int, key: PRNGKeyArray
) -> tuple[Float[Array, " m"], Float[Array, " m"], Float[Array, "m size"]]:
    """`iterations` Lanczos steps with full reorthogonalisation.

    Returns the tridiagonal T (diagonal `alpha`, off-diagonal `beta[:-1]`) and the
    orthonormal basis V (rows), V A Vᵀ = T. When the Krylov space becomes invariant
    (β ≈ 0: a low-rank curvature), the iteration restarts from a random vector
    orthogonal to the basis and T decouples, so `iterations = size` gives every
    eigenvalue.
    """
    size, dtype = operator.size, operator.dtype
    eps = jnp.finfo(dtype).eps
    start_key, restart_key = jax.random.split(key)
    basis = (
        jnp.zeros((iterations + 1, size), dtype)
        .at[0]
        .set(_unit(start_key, size, dtype))
    )

    def orthogonalise(basis, w):
        # Classical Gram-Schmidt twice: orthogonal to working precision.
        for _ in range(2):
            w = w - basis.T @ (basis @ w)
        return w

    def step(j, carry):
        basis, alpha, beta, scale = carry
        v = basis[j]
        av = operator.matmat(v[:, None])[:, 0]
        a = jnp.dot(v, av)
        w = orthogonalise(basis, av)
        b = jnp.linalg.norm(w)
        scale = jnp.maximum(scale, jnp.linalg.norm(av))
        broken = b <= 10 * jnp.sqrt(size) * eps * scale
        fresh = orthogonalise(
            basis, _unit(jax.random.fold_in(restart_key, j), size, dtype)
        )
        nxt = jnp.where(
            broken, fresh / jnp.linalg.norm(fresh), w / jnp.where(broken, 1, b)
        )
        return (
            basis.at[j + 1].set(nxt),
            alpha.at[j].set(a),
            beta.at[j].set(jnp.where(broken, 0, b)),
            scale,
        )

    zeros = jnp.zeros((iterations,), dtype)
    init = (basis, zeros, zeros, jnp.zeros((), dtype))
    basis, alpha, beta, _ = jax.lax.fori_loop(0, iterations, step, init)
    return alpha, beta, basis[:iterations]


def lanczos_recurrence(
    operator: FlatOperator, iterations: int, key: PRNGKeyArray
) -> tuple[Float[Array, " m"], Float[Array, " m"]]:
    """`iterations` plain Lanczos steps (three-term recurrence, no stored basis):
    memory O(size) rather than O(iterations·size), at the price of orthogonality.

    Returns T as in `lanczos_basis`. A breakdown (β ≈ 0) restarts from a fresh
    random vector and decouples T.
    """
    size, dtype = operator.size, operator.dtype
    eps = jnp.finfo(dtype).eps
    start_key, restart_key = jax.random.split(key)

    def step(j, carry):
        v_prev, v, b_prev, alpha, beta, scale = carry
        av = operator.matmat(v[:, None])[:, 0]
        a = jnp.dot(v, av)
        w = av - a * v - b_prev * v_prev
        b = jnp.linalg.norm(w)
        scale = jnp.maximum(scale, jnp.linalg.norm(av))
        broken = b <= 10 * jnp.sqrt(size) * eps * scale
        fresh = _unit(jax.random.fold_in(restart_key, j), size, dtype)
        nxt = jnp.where(broken, fresh, w / jnp.where(broken, 1, b))
        b = jnp.where(broken, 0, b)
        return v, nxt, b, alpha.at[j].set(a), beta.at[j].set(b), scale

    zeros = jnp.zeros((iterations,), dtype)
    v0 = _unit(start_key, size, dtype)
    init = (jnp.zeros_like(v0), v0, jnp.zeros((), dtype), zeros, zeros, zeros[0])
    *_, alpha, beta, _ = jax.lax.fori_loop(0, iterations, step, init)
    return alpha, beta


def tridiagonal_eigh(
    alpha: Float[Array, " m"], beta: Float[Array, " m"]
) -> tuple[Float[Array, " m"], Float[Array, "m m"]]:
    """Eigenvalues (ascending) and eigenvectors (columns) of the Lanczos T."""
    off = beta[:-1]
    t = jnp.diag(alpha) + jnp.diag(off, 1) + jnp.diag(off, -1)
    return linalg.eigh(t)
