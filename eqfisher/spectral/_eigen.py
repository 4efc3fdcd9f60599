"""Top eigenpairs and extreme eigenvalues by Lanczos."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._refusal import check_count, check_key
from ._flat import checked_symmetric, flatten, require_factorisable
from ._lanczos import lanczos_basis, lanczos_recurrence, tridiagonal_eigh


@eqx.filter_jit
def top_eigenpairs(
    operator: lx.AbstractLinearOperator,
    k: int,
    *,
    key: PRNGKeyArray,
    iterations: int | None = None,
    which: Literal["largest", "smallest"] = "largest",
) -> tuple[Float[Array, " k"], PyTree[Float[Array, "k ..."]]]:
    r"""The $k$ largest (or smallest) eigenvalues of a symmetric operator and their
    eigenvectors, by Lanczos with full reorthogonalisation.

    Ritz pairs of `iterations` Lanczos steps (`iterations` products, memory
    `iterations` × the number of parameters). The extreme eigenvalues converge
    first; `iterations` equal to the number of parameters gives them to working
    precision. A Ritz value is never beyond the true one ($\lambda_k \ge \theta_k$ for
    `"largest"`). A repeated eigenvalue's further copies converge slowly (one
    starting vector; see docs/spectral.md): raise `iterations` for them.

    **Arguments:**

    - `operator`: a symmetric lineax operator over parameter PyTrees (a curvature,
      `eqfisher.ggn_operator`, `eqfisher.hessian_operator`, ...).
    - `k`: the number of eigenpairs.
    - `key`: a PRNG key for the starting vector.
    - `iterations`: Lanczos steps, at least `k` and at most the number of
      parameters; default `min(size, max(2k + 20, 40))`.
    - `which`: `"largest"` (default; descending order) or `"smallest"` (ascending).

    **Returns:**

    `(eigenvalues, eigenvectors)`: `eigenvalues` of shape `(k,)`; `eigenvectors` a
    PyTree like the parameters with a leading axis of size k on every leaf
    (eigenvector i is `jax.tree.map(lambda x: x[i], eigenvectors)`), each of unit
    norm.

    !!! Example

        ```python
        values, vectors = ef.spectral.top_eigenpairs(hessian, 3, key=key)
        sharpness = values[0]
        ```
    """
    caller = "eqfisher.spectral.top_eigenpairs"
    check_key(caller, key)
    flat = flatten(operator, caller)
    require_factorisable(flat, caller)
    check_count(k, "k", caller)
    if k > flat.size:
        raise ValueError(
            f"`{caller}(operator, k={k})`: `k` must be at most the operator's size "
            f"{flat.size} (the parameters it covers); pass `k <= {flat.size}`, or "
            "take every eigenpair from `jnp.linalg.eigh(operator.as_matrix())`."
        )
    if iterations is None:
        iterations = min(flat.size, max(2 * k + 20, 40))
    elif not isinstance(iterations, int) or isinstance(iterations, bool):
        check_count(iterations, "iterations", caller)
    elif not k <= iterations <= flat.size:
        raise ValueError(
            f"`{caller}(operator, k={k}, iterations={iterations})`: `iterations` "
            f"must lie in [k, size] = [{k}, {flat.size}] (at least one Lanczos "
            "step per eigenpair, at most one per parameter); leave it out for "
            "the default."
        )
    if which not in ("largest", "smallest"):
        raise ValueError(
            f"`{caller}(..., which=...)` must be 'largest' or 'smallest', "
            f"got {which!r}."
        )
    alpha, beta, basis = lanczos_basis(flat, iterations, key)
    theta, y = tridiagonal_eigh(alpha, beta)
    order = jnp.arange(iterations - 1, iterations - 1 - k, -1)
    if which == "smallest":
        order = jnp.arange(k)
    vectors = (basis.T @ y[:, order]).T
    pairs = (theta[order], jax.vmap(flat.unravel)(vectors))
    return checked_symmetric(flat, key, caller, pairs)


@eqx.filter_jit
def extreme_eigenvalues(
    operator: lx.AbstractLinearOperator,
    *,
    iterations: int,
    key: PRNGKeyArray,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""Estimates of the smallest and largest eigenvalues of a symmetric operator,
    from `iterations` plain Lanczos steps (no stored basis: memory of a few
    parameter vectors).

    The extreme Ritz values converge fastest of all: a few tens of products give
    the largest eigenvalue (the sharpness) to a few digits on curvature matrices.
    In exact arithmetic the estimates lie inside $[\lambda_{\min}, \lambda_{\max}]$.

    **Arguments:**

    - `operator`: a symmetric lineax operator over parameter PyTrees.
    - `iterations`: the number of Lanczos steps (operator products).
    - `key`: a PRNG key for the starting vector.

    **Returns:**

    `(smallest, largest)`, two scalars.

    !!! Example

        ```python
        low, high = ef.spectral.extreme_eigenvalues(hessian, iterations=30, key=key)
        ```
    """
    caller = "eqfisher.spectral.extreme_eigenvalues"
    check_count(iterations, "iterations", caller)
    check_key(caller, key)
    flat = flatten(operator, caller)
    require_factorisable(flat, caller)
    alpha, beta = lanczos_recurrence(flat, iterations, key)
    theta, _ = tridiagonal_eigh(alpha, beta)
    return checked_symmetric(flat, key, caller, (theta[0], theta[-1]))
