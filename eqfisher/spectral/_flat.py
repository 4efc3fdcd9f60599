"""A lineax operator over parameter PyTrees, seen as a matrix on flat vectors."""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._products import linearised
from .._refusal import refused_where


Distribution = Literal["rademacher", "normal"]
DISTRIBUTIONS = ("rademacher", "normal")


class FlatOperator(eqx.Module):
    """`operator` acting on flat vectors, the `ravel_pytree` order of its operand.

    Products with several vectors at once (the columns of a matrix) run through
    `jax.vmap` of the operator's `mv`, or `jax.lax.map` in chunks of `batch_size`
    columns when that is set (to bound memory).
    """

    operator: lx.AbstractLinearOperator
    treedef: object = eqx.field(static=True)
    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    symmetric: bool = eqx.field(static=True)
    batch_size: int | None = eqx.field(static=True)

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def ravel(self, tree) -> Float[Array, " size"]:
        leaves = jax.tree_util.tree_leaves(tree)
        return jnp.concatenate([jnp.ravel(x).astype(self.dtype) for x in leaves])

    def unravel(self, flat: Float[Array, " size"]):
        offsets = np.cumsum([0] + [math.prod(s) for s in self.shapes])
        leaves = [
            flat[a:b].reshape(s) for a, b, s in zip(offsets, offsets[1:], self.shapes)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _columns(self, fn, vectors: Float[Array, "size k"]) -> Float[Array, "size k"]:
        if jnp.ndim(vectors) != 2 or jnp.shape(vectors)[0] != self.size:
            # `vectors` P + 1 rows long had its last row dropped, no error.
            raise ValueError(
                "`matmat(vectors)` / `rmatmat(vectors)`: `vectors` must be a matrix "
                f"of the operator's size rows, shape ({self.size}, k), got shape "
                f"{jnp.shape(vectors)}."
            )
        vectors = jnp.asarray(vectors, self.dtype)  # the operator's, as `ravel`
        if self.batch_size is None:
            return jax.vmap(fn, in_axes=1, out_axes=1)(vectors)
        return jax.lax.map(fn, vectors.T, batch_size=self.batch_size).T

    def matmat(self, vectors: Float[Array, "size k"]) -> Float[Array, "size k"]:
        """A V, one operator product per column of V."""
        return self._columns(
            lambda v: self.ravel(self.operator.mv(self.unravel(v))), vectors
        )

    def rmatmat(self, vectors: Float[Array, "size k"]) -> Float[Array, "size k"]:
        """Aᵀ V (the same products as `matmat` for a symmetric operator)."""
        if self.symmetric:
            return self.matmat(vectors)
        transposed = self.operator.transpose()
        return self._columns(
            lambda v: self.ravel(transposed.mv(self.unravel(v))), vectors
        )


def require_factorisable(operator: FlatOperator, caller: str) -> None:
    """Refuses a half-precision operand where `caller` factorises in its dtype (a
    QR of its products, a tridiagonal eigendecomposition): jax's linear algebra
    has no bfloat16 or float16 kernels (its error named neither)."""
    if jnp.finfo(operator.dtype).bits < 32:
        raise TypeError(
            f"`{caller}` factorises (QR, eigh) in the operand's dtype, "
            f"{jnp.dtype(operator.dtype).name}, which jax's linear algebra does "
            "not support: build the operator from the model cast to float32, e.g. "
            "`jax.tree.map(lambda x: x.astype(jnp.float32) if "
            "eqx.is_inexact_array(x) else x, model)` (`Hutchinson` and "
            "`squared_frobenius_norm` work in half precision)."
        )


def flatten(
    operator: lx.AbstractLinearOperator, caller: str, batch_size: int | None = None
) -> FlatOperator:
    """`operator` as a `FlatOperator`, after checking it is square with one dtype."""
    if not isinstance(operator, lx.AbstractLinearOperator):
        # An array passed in is a tracer here (the callers are `filter_jit`-ed).
        got = (
            f"an array of shape {tuple(operator.shape)} (wrap a matrix as "
            "`lineax.MatrixLinearOperator(matrix, lineax.symmetric_tag)`)"
            if isinstance(operator, jax.Array)
            else type(operator).__name__
        )
        raise TypeError(
            f"`{caller}(operator, ...)`: `operator` must be a lineax operator (e.g. "
            f"eqfisher.curvature(...), eqfisher.ggn_operator(...), "
            f"lineax.MatrixLinearOperator(...)), got {got}."
        )
    structure = operator.in_structure()
    leaves, treedef = jax.tree_util.tree_flatten(structure)
    out_leaves, out_treedef = jax.tree_util.tree_flatten(operator.out_structure())
    shapes = tuple(tuple(s.shape) for s in leaves)
    if out_treedef != treedef or tuple(tuple(s.shape) for s in out_leaves) != shapes:
        raise ValueError(
            f"`{caller}(operator, ...)`: `operator` must be square (its output "
            "structure the same as its input structure), as curvature operators are."
        )
    dtypes = {jnp.dtype(s.dtype) for s in leaves}
    if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
        raise TypeError(
            f"`{caller}(operator, ...)`: the operand's leaves must share one floating "
            f"dtype, got {sorted(str(d) for d in dtypes)}; cast the model first, e.g. "
            "`jax.tree.map(lambda x: x.astype(jnp.float32), model)`."
        )
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(
            f"`{caller}(..., batch_size=...)` must be a positive integer or None (one "
            f"vmap over all vectors), got {batch_size!r}."
        )
    return FlatOperator(
        linearised(operator),
        treedef,
        shapes,
        next(iter(dtypes)),
        _is_symmetric(operator),
        batch_size,
    )


def _is_symmetric(operator: lx.AbstractLinearOperator) -> bool:
    # A user's operator type that lineax was not told about counts as unsymmetric:
    # its transpose is then used where one is needed.
    try:
        return bool(lx.is_symmetric(operator))
    except NotImplementedError:
        return False


def checked_symmetric(flat: FlatOperator, key: PRNGKeyArray, caller: str, carrier):
    """`carrier`, after checking an operator lineax does not know to be symmetric
    (an untagged `lineax.MatrixLinearOperator`, say) with one probe, uᵀAv = vᵀAu
    for random u, v (two products): an eigenvalue method on an unsymmetric matrix
    returns numbers that mean nothing. Equinox's runtime error under `jit`."""
    if flat.symmetric:
        return carrier
    probe = jax.random.fold_in(key, 0x5E77)
    uv = random_vectors(probe, flat.size, 2, "normal", flat.dtype)
    a = flat.matmat(uv)
    asymmetry = jnp.abs(uv[:, 0] @ a[:, 1] - uv[:, 1] @ a[:, 0])
    norms = jnp.linalg.norm(uv, axis=0) * jnp.linalg.norm(a, axis=0)
    bad = asymmetry > 1e-3 * jnp.sum(norms) + jnp.finfo(flat.dtype).tiny
    message = (
        f"`{caller}(operator, ...)`: `operator` is not symmetric (uᵀAv ≠ vᵀAu for "
        "random u, v), and its eigenvalues by Lanczos would mean nothing. Pass a "
        "symmetric operator: a curvature, `eqfisher.ggn_operator`, "
        "`eqfisher.hessian_operator`, or a matrix tagged "
        "`lineax.MatrixLinearOperator(matrix, lineax.symmetric_tag)`."
    )
    return refused_where(carrier, bad, message)


def check_distribution(distribution: str, caller: str) -> None:
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
            f"`{caller}(distribution=...)` must be one of {DISTRIBUTIONS}, "
            f"got {distribution!r}."
        )


def random_vectors(
    key: PRNGKeyArray, size: int, count: int, distribution: Distribution, dtype
) -> Float[Array, "size count"]:
    """`count` independent vectors with E[v vᵀ] = I, as the columns of a matrix."""
    if distribution == "rademacher":
        return _rademacher(key, (size, count), dtype)
    return jax.random.normal(key, (size, count), dtype=dtype)


def _rademacher(key: PRNGKeyArray, shape: tuple[int, ...], dtype) -> Array:
    """Independent signs, ±1 with equal probability: the 32 bits of each of
    `jax.random.bits`' words give 32 of them. `jax.random.rademacher` draws a word
    per sign, and on the CPU drawing the words is most of a Hutchinson product's
    time: 130 against 18 ms for 40 vectors of 400,000 (benchmarks/RESULTS.md,
    "Issue 26, twenty-eighth session")."""
    n = math.prod(shape)
    words = jax.random.bits(key, (-(-n // 32), 1), jnp.uint32)
    bits = (words >> jnp.arange(32, dtype=jnp.uint32)[None, :]) & 1
    return (2 * bits.astype(dtype) - 1).reshape(-1)[:n].reshape(shape)
