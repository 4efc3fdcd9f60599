"""Hutchinson's estimator of the squared Frobenius norm."""

import equinox as eqx
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Float, PRNGKeyArray

from .._refusal import check_count, check_key
from ._flat import (
    Distribution,
    check_distribution,
    flatten,
    random_vectors,
)


@eqx.filter_jit
def squared_frobenius_norm(
    operator: lx.AbstractLinearOperator,
    *,
    matvecs: int,
    key: PRNGKeyArray,
    distribution: Distribution = "rademacher",
    batch_size: int | None = None,
) -> Float[Array, ""]:
    r"""A randomised estimate of the squared Frobenius norm:

    $$
    \lVert A \rVert_F^2 = \operatorname{tr}(A^\top A)
    \approx \frac{1}{m} \sum_i \lVert A w_i \rVert^2.
    $$

    Unbiased; with Rademacher vectors its variance is
    $2 (\lVert A^\top A \rVert_F^2 - \sum_j (A^\top A)_{jj}^2) / m$.

    **Arguments:**

    - `operator`: a square lineax operator over parameter PyTrees.
    - `matvecs`: m, the number of products.
    - `key`: a PRNG key for the random vectors.
    - `distribution`: `"rademacher"` (default) or `"normal"`.
    - `batch_size`: as in [`eqfisher.spectral.trace`][].

    **Returns:**

    A scalar.

    !!! Example

        ```python
        f2 = ef.spectral.squared_frobenius_norm(ggn, matvecs=50, key=key)
        ```
    """
    caller = "eqfisher.spectral.squared_frobenius_norm"
    check_count(matvecs, "matvecs", caller)
    check_distribution(distribution, caller)
    check_key(caller, key)
    flat = flatten(operator, caller, batch_size)
    w = random_vectors(key, flat.size, matvecs, distribution, flat.dtype)
    return jnp.sum(flat.matmat(w) ** 2) / matvecs
