"""Randomised trace and diagonal estimators: Hutchinson, Hutch++ (and Diag++), XTrace
(and XDiag)."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .. import _linalg as linalg
from .._refusal import check_count, check_key
from ._flat import (
    Distribution,
    FlatOperator,
    check_distribution,
    flatten,
    random_vectors,
    require_factorisable,
)


class AbstractTraceEstimator(eqx.Module):
    r"""A randomised estimator of the trace and of the diagonal of a square operator,
    from `matvecs` operator products with random vectors.

    Pass one to [`eqfisher.spectral.trace`][] or [`eqfisher.spectral.diagonal`][].
    Every estimator here is unbiased; they differ in variance. `distribution` is
    that of the random vectors' entries: `"rademacher"` (±1, the lower variance) or
    `"normal"`.

    A subclass sets `matvecs` and `distribution` and implements `trace` and
    `diagonal`, which receive the operator flattened: `operator.size` (the number
    of parameters $P$), `operator.dtype`, `operator.matmat(V)` ($AV$ for a
    `(P, k)` matrix $V$, one product per column, through `jax.vmap` or the
    caller's `batch_size`) and `operator.rmatmat(V)` ($A^\top V$), on vectors in
    `jax.flatten_util.ravel_pytree` order. For example, the exact trace from all
    P columns, `jnp.trace(operator.matmat(jnp.eye(operator.size,
    dtype=operator.dtype)))`.

    !!! Example

        ```python
        # A 50 × 50 operator with eigenvalues 1, 1/4, ..., 1/50²: trace ≈ 1.625.
        q, _ = jnp.linalg.qr(jax.random.normal(key, (50, 50)))
        matrix = (q / jnp.arange(1.0, 51.0) ** 2) @ q.T
        operator = lx.MatrixLinearOperator(matrix, lx.positive_semidefinite_tag)
        for estimator in (
            ef.spectral.Hutchinson(matvecs=12),
            ef.spectral.HutchPlusPlus(matvecs=12),
            ef.spectral.XTrace(matvecs=12),
        ):
            t = ef.spectral.trace(operator, estimator, key=key)
            print(type(estimator).__name__, t, jnp.trace(matrix))
        # All near 1.625; on a fast-decaying spectrum such as this one the sketching
        # estimators (Hutch++, XTrace) usually come closer for the same `matvecs`.
        ```
    """

    matvecs: eqx.AbstractVar[int]
    distribution: eqx.AbstractVar[Distribution]

    @abc.abstractmethod
    def trace(self, operator: FlatOperator, key: PRNGKeyArray) -> Float[Array, ""]:
        """The trace estimate of `operator` (flattened) from `self.matvecs` products."""

    @abc.abstractmethod
    def diagonal(
        self, operator: FlatOperator, key: PRNGKeyArray
    ) -> Float[Array, " size"]:
        """The diagonal estimate of `operator` (flattened), a flat vector."""

    def _vectors(self, key, operator: FlatOperator, count: int, *, sketch=True):
        """`count` random vectors; a sketch (a basis from their products) of more
        than the operator's size is refused: its QR would be degenerate."""
        name = type(self).__name__
        if sketch:  # QR'd
            require_factorisable(operator, f"{name}(matvecs={self.matvecs})")
        if sketch and count > operator.size:
            raise ValueError(
                f"`{name}(matvecs={self.matvecs})` draws {count} vectors, more than the "
                f"operator's size {operator.size}: lower `matvecs`, or compute the "
                "quantity exactly from `operator.as_matrix()`."
            )
        return random_vectors(
            key, operator.size, count, self.distribution, operator.dtype
        )


class Hutchinson(AbstractTraceEstimator):
    r"""Hutchinson's estimator of the trace and the diagonal:

    $$
    \operatorname{tr}(A) \approx \frac{1}{m} \sum_i w_i^\top A w_i, \qquad
    \operatorname{diag}(A) \approx \frac{1}{m} \sum_i w_i \odot A w_i.
    $$

    With Rademacher vectors the trace estimate has variance
    $2 (\lVert A \rVert_F^2 - \sum_j A_{jj}^2) / m$ (symmetric $A$), the diagonal
    entry $j$ variance $\sum_{l \ne j} A_{jl}^2 / m$.

    **Arguments:**

    - `matvecs`: m, the number of products (and random vectors).
    - `distribution`: `"rademacher"` (default) or `"normal"`.

    !!! Example

        ```python
        # A diagonal operator: ±1 vectors give its trace (1275) with no error, as
        # the variance above is zero; normal vectors only on average.
        operator = lx.MatrixLinearOperator(
            jnp.diag(jnp.arange(1.0, 51.0)), lx.positive_semidefinite_tag
        )
        rademacher = ef.spectral.Hutchinson(matvecs=12)
        normal = ef.spectral.Hutchinson(matvecs=12, distribution="normal")
        print(ef.spectral.trace(operator, rademacher, key=key))  # 1275.0
        print(ef.spectral.trace(operator, normal, key=key))  # near 1275
        ```
    """

    matvecs: int = eqx.field(static=True)
    distribution: Distribution = eqx.field(static=True, default="rademacher")

    def __check_init__(self):
        check_count(self.matvecs, "matvecs", "eqfisher.spectral.Hutchinson")
        check_distribution(self.distribution, "eqfisher.spectral.Hutchinson")

    def trace(self, operator: FlatOperator, key: PRNGKeyArray) -> Float[Array, ""]:
        w = self._vectors(key, operator, self.matvecs, sketch=False)
        return jnp.sum(w * operator.matmat(w)) / self.matvecs

    def diagonal(
        self, operator: FlatOperator, key: PRNGKeyArray
    ) -> Float[Array, " size"]:
        w = self._vectors(key, operator, self.matvecs, sketch=False)
        return jnp.mean(w * operator.matmat(w), axis=1)


class HutchPlusPlus(AbstractTraceEstimator):
    r"""Hutch++ (Meyer, Musco, Musco and Woodruff, 2021) and its diagonal analogue
    Diag++ (Baston and Nakatsukasa, 2022).

    A third of the products sketch the range of $A$ ($Q = \operatorname{orth}(A S)$),
    where the trace (or diagonal of $Q Q^\top A$) is computed exactly; the rest goes
    to Hutchinson's estimator on the complement $I - Q Q^\top$. Exact when
    $\operatorname{rank}(A) \le \text{matvecs} / 3$.

    **Arguments:**

    - `matvecs`: the number of products, a multiple of 3.
    - `distribution`: `"rademacher"` (default) or `"normal"`.

    !!! Example

        ```python
        u = jax.random.normal(key, (50, 4))
        operator = lx.MatrixLinearOperator(u @ u.T, lx.positive_semidefinite_tag)
        # Rank 4 ≤ 12/3: the sketch holds the whole range and the estimate is exact.
        t = ef.spectral.trace(operator, ef.spectral.HutchPlusPlus(matvecs=12), key=key)
        print(t, jnp.sum(u**2))  # equal
        ```
    """

    matvecs: int = eqx.field(static=True)
    distribution: Distribution = eqx.field(static=True, default="rademacher")

    def __check_init__(self):
        check_count(
            self.matvecs, "matvecs", "eqfisher.spectral.HutchPlusPlus", minimum=3
        )
        check_distribution(self.distribution, "eqfisher.spectral.HutchPlusPlus")
        if self.matvecs % 3:
            raise ValueError(
                "`eqfisher.spectral.HutchPlusPlus(matvecs=...)` must be a multiple of "
                f"3 (sketch, its trace, the complement), got {self.matvecs}."
            )

    def _sketch(self, operator: FlatOperator, key: PRNGKeyArray):
        n = self.matvecs // 3
        sketch_key, test_key = jax.random.split(key)
        q, _ = linalg.qr(operator.matmat(self._vectors(sketch_key, operator, n)))
        return q, self._vectors(test_key, operator, n)

    def trace(self, operator: FlatOperator, key: PRNGKeyArray) -> Float[Array, ""]:
        q, g = self._sketch(operator, key)
        exact = jnp.sum(q * operator.matmat(q))
        apg = operator.matmat(g - q @ (q.T @ g))
        papg = apg - q @ (q.T @ apg)
        return exact + jnp.sum(g * papg) / g.shape[1]

    def diagonal(
        self, operator: FlatOperator, key: PRNGKeyArray
    ) -> Float[Array, " size"]:
        q, g = self._sketch(operator, key)
        exact = jnp.sum(q * operator.rmatmat(q), axis=1)  # diag(Q Qᵀ A)
        ag = operator.matmat(g)
        return exact + jnp.mean(g * (ag - q @ (q.T @ ag)), axis=1)


def _leave_one_out(r: Float[Array, "k k"]) -> Float[Array, "k k"]:
    """Column i: a unit vector orthogonal to every column of `r` but the i-th.

    Q (I − sᵢsᵢᵀ) Qᵀ then projects onto the range of the sketch without its i-th
    vector. These are the normalised columns of R⁻ᵀ (Epperly et al.), computed from
    an SVD with the singular values floored at ε·σ₁: for a rank-deficient sketch (a
    low-rank curvature) the columns then lie in R's null space, any vector of which
    serves (the sketch holds the whole range), instead of being infinite.
    """
    u, sigma, vt = linalg.svd(r)
    floor = jnp.maximum(jnp.finfo(r.dtype).eps * sigma[0], jnp.finfo(r.dtype).tiny)
    s = (u / jnp.maximum(sigma, floor)[None, :]) @ vt
    return s / jnp.linalg.norm(s, axis=0, keepdims=True)


def _deflate(x: Float[Array, "k k"], s: Float[Array, "k k"]) -> Float[Array, "k k"]:
    """Column i of `x` times (I − sᵢsᵢᵀ)."""
    return x - s * jnp.sum(s * x, axis=0, keepdims=True)


class XTrace(AbstractTraceEstimator):
    """XTrace and XDiag (Epperly, Tropp and Webber, 2024): Hutch++ with every random
    vector used both in the sketch and as a test vector (exchangeability).

    Half of the products sketch the range of A with k = `matvecs`/2 vectors, the
    other half apply A to its orthonormal basis. The estimate averages, over i, the
    exact part in the basis without vector i plus Hutchinson's estimate with vector
    i on its complement. Exact when rank(A) < `matvecs`/2.

    **Arguments:**

    - `matvecs`: the number of products, an even number.
    - `distribution`: `"rademacher"` (default) or `"normal"`.

    !!! Example

        ```python
        u = jax.random.normal(key, (50, 4))
        operator = lx.MatrixLinearOperator(u @ u.T, lx.positive_semidefinite_tag)
        # Rank 4 < 12/2: exact, for the trace and (XDiag) the diagonal.
        estimator = ef.spectral.XTrace(matvecs=12)
        print(ef.spectral.trace(operator, estimator, key=key), jnp.sum(u**2))  # equal
        d = ef.spectral.diagonal(operator, estimator, key=key)
        assert jnp.allclose(d, jnp.sum(u**2, axis=1), rtol=1e-3)
        ```
    """

    matvecs: int = eqx.field(static=True)
    distribution: Distribution = eqx.field(static=True, default="rademacher")

    def __check_init__(self):
        check_count(self.matvecs, "matvecs", "eqfisher.spectral.XTrace", minimum=4)
        check_distribution(self.distribution, "eqfisher.spectral.XTrace")
        if self.matvecs % 2:
            raise ValueError(
                "`eqfisher.spectral.XTrace(matvecs=...)` must be even (a sketch and "
                f"the products with its basis), got {self.matvecs}."
            )

    def _sketch(self, operator: FlatOperator, key: PRNGKeyArray):
        w = self._vectors(key, operator, self.matvecs // 2)
        y = operator.matmat(w)
        q, r = linalg.qr(y)
        return w, y, q, _leave_one_out(r)

    def trace(self, operator: FlatOperator, key: PRNGKeyArray) -> Float[Array, ""]:
        w, y, q, s = self._sketch(operator, key)
        aq = operator.matmat(q)
        h = q.T @ aq
        exact = jnp.trace(h) - jnp.sum(s * (h @ s), axis=0)
        apw = y - aq @ _deflate(q.T @ w, s)
        papw = apw - q @ _deflate(q.T @ apw, s)
        return jnp.mean(exact + jnp.sum(w * papw, axis=0))

    def diagonal(
        self, operator: FlatOperator, key: PRNGKeyArray
    ) -> Float[Array, " size"]:
        w, y, q, s = self._sketch(operator, key)
        atq = operator.rmatmat(q)  # (Qᵀ A)ᵀ
        k = w.shape[1]
        exact = jnp.sum(q * atq, axis=1) - jnp.sum((q @ s) * (atq @ s), axis=1) / k
        complement = y - q @ _deflate(q.T @ y, s)
        return exact + jnp.mean(w * complement, axis=1)


def _check_estimator(estimator, caller: str) -> None:
    if not isinstance(estimator, AbstractTraceEstimator):
        raise TypeError(
            f"`{caller}(operator, estimator, ...)`: `estimator` must be an "
            "eqfisher.spectral estimator such as Hutchinson(matvecs=100), "
            f"HutchPlusPlus(matvecs=99) or XTrace(matvecs=100), got {estimator!r}."
        )


@eqx.filter_jit
def trace(
    operator: lx.AbstractLinearOperator,
    estimator: AbstractTraceEstimator,
    *,
    key: PRNGKeyArray,
    batch_size: int | None = None,
) -> Float[Array, ""]:
    """A randomised estimate of the trace of a square operator.

    **Arguments:**

    - `operator`: a lineax operator over parameter PyTrees, e.g. from
      `eqfisher.curvature`, `eqfisher.ggn_operator` or `eqfisher.hessian_operator`.
    - `estimator`: `Hutchinson(matvecs=...)`, `HutchPlusPlus(matvecs=...)` or
      `XTrace(matvecs=...)`.
    - `key`: a PRNG key for the random vectors.
    - `batch_size`: `None` (default) applies the operator to all vectors in one
      `jax.vmap`; an integer applies it to that many at a time (`jax.lax.map`), to
      bound memory (on the CPU, also the faster for models of some 10⁵ parameters
      and more: docs/spectral.md).

    **Returns:**

    A scalar.

    **Raises:**

    - `TypeError` when `operator` is not a lineax operator, its operand's leaves
      do not share one floating dtype, or `estimator` is not an
      `eqfisher.spectral` estimator.
    - `ValueError` when `operator` is not square, `batch_size` is not a
      positive integer or `None`, or a sketching estimator (`HutchPlusPlus`,
      `XTrace`) draws more vectors than the operator's size (`Hutchinson` may
      draw any number).

    !!! Example

        ```python
        ggn = ef.ggn_operator(loss_fn, model, batch)
        t = ef.spectral.trace(ggn, ef.spectral.XTrace(matvecs=40), key=key)
        ```
    """
    caller = "eqfisher.spectral.trace"
    _check_estimator(estimator, caller)
    check_key(caller, key)
    t = estimator.trace(flatten(operator, caller, batch_size), key)
    if _shape(t) != ():
        raise ValueError(
            f"`{caller}`: `{type(estimator).__name__}.trace(operator, key)` must "
            f"return a scalar, got {_shape(t) or type(t).__name__}."
        )
    return t


def _shape(x) -> tuple[int, ...] | None:
    """The shape of an array or a Python number; None for anything else (a tuple
    of arrays, which `jnp.shape` would try to stack)."""
    if isinstance(x, int | float) or hasattr(x, "shape"):
        return tuple(jnp.shape(x))
    return None


@eqx.filter_jit
def diagonal(
    operator: lx.AbstractLinearOperator,
    estimator: AbstractTraceEstimator,
    *,
    key: PRNGKeyArray,
    batch_size: int | None = None,
) -> PyTree[Float[Array, "..."]]:
    """A randomised estimate of the diagonal of a square operator.

    `Hutchinson` is Hutchinson's diagonal estimator, `HutchPlusPlus` is Diag++,
    `XTrace` is XDiag.

    **Arguments:**

    - `operator`: a lineax operator over parameter PyTrees.
    - `estimator`: `Hutchinson(matvecs=...)`, `HutchPlusPlus(matvecs=...)` or
      `XTrace(matvecs=...)`.
    - `key`: a PRNG key for the random vectors.
    - `batch_size`: as in [`eqfisher.spectral.trace`][].

    **Returns:**

    The diagonal as a PyTree like the operator's operand (the parameters).

    !!! Example

        ```python
        d = ef.spectral.diagonal(ggn, ef.spectral.XTrace(matvecs=40), key=key)
        ```
    """
    caller = "eqfisher.spectral.diagonal"
    _check_estimator(estimator, caller)
    check_key(caller, key)
    flat = flatten(operator, caller, batch_size)
    d = estimator.diagonal(flat, key)
    if _shape(d) != (flat.size,):
        raise ValueError(
            f"`{caller}`: `{type(estimator).__name__}.diagonal(operator, key)` must "
            f"return a flat vector of the operator's size, shape ({flat.size},), "
            f"got {_shape(d) or type(d).__name__}."
        )
    return flat.unravel(d)
