from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, ScalarLike

from .. import _linalg as linalg
from ._base import (
    AbstractBlock,
    Operand,
    Structure,
    check_damping,
    check_operand,
    check_same,
    check_scalar,
    normalise_structure,
    ravel,
    structure_size,
    unravel,
)


class Full(AbstractBlock):
    r"""A dense curvature block: the whole (P, P) matrix of one layer.

    **Fields:**

    - `matrix`: the symmetric PSD matrix B, shape `(P, P)`, rows and columns in the
        `ravel_pytree` order of the operand tuple.
    - `structure`: the operand, a tuple of `jax.ShapeDtypeStruct` (static).
    - `eig`: `None`, or `(eigenvalues, eigenvectors)` of B from `precompute()`
        (eigenvalues clamped at zero).

    Without `eig`, `solve` and `logdet` use a Cholesky factorisation of
    $B + \text{damping} \cdot I$. Where it fails, because rounding has left $B$ with
    eigenvalues below $-\text{damping}$ (float32 with
    $\text{damping} \lesssim 10^{-7} \lVert B \rVert$), they fall back to an
    eigendecomposition with the eigenvalues of $B$ clamped at zero: the exact result
    for the nearest PSD matrix, finite for any positive damping. With `eig` (after
    `precompute()`), they reuse the eigendecomposition for any damping: a solve costs
    two matrix-vector products and `logdet` a sum over the eigenvalues, and both are
    differentiable in `damping` without differentiating a factorisation (the Laplace
    marginal likelihood's tuning does this). `eigenvalues` are in ascending order
    (`jnp.linalg.eigvalsh`).

    !!! Example

        ```python
        weight, bias = jnp.zeros((2, 3)), jnp.zeros(2)  # a 3 → 2 layer: P = 8
        root = jax.random.normal(key, (8, 8))
        block = ef.blocks.Full(root @ root.T, (weight, bias))
        v = (jnp.ones((2, 3)), jnp.arange(2.0))
        # (B + ½·I)⁻¹ (B v + ½·v) = v
        rhs = tuple(bv + 0.5 * x for bv, x in zip(block.mv(v), v))
        assert all(jnp.allclose(u, x, atol=1e-4) for u, x in zip(block.solve(rhs, 0.5), v))
        print(block.logdet(0.5))  # log det(B + ½·I), by Cholesky
        ```
    """

    averages_batches = True  # `ema` averages the matrices

    matrix: Float[Array, "size size"]
    structure: Structure = eqx.field(static=True)
    eig: tuple[Float[Array, " size"], Float[Array, "size size"]] | None

    def __init__(
        self,
        matrix: Float[ArrayLike, "size size"],
        structure: tuple[object, ...],
        *,
        eig: tuple[Float[Array, " size"], Float[Array, "size size"]] | None = None,
    ):
        """**Arguments:**

        - `matrix`: the symmetric PSD matrix, shape `(P, P)`, in the ravel order of
            the operand.
        - `structure`: the operand's leaves, as anything with `.shape` and `.dtype`
            (arrays or `jax.ShapeDtypeStruct`s), e.g. `(weight, bias)`.
        - `eig`: an optional precomputed `jnp.linalg.eigh` of `matrix` (see
            `precompute`).
        """
        self.matrix = jnp.asarray(matrix)
        self.structure = normalise_structure(structure)
        # A plain tuple (`jnp.linalg.eigh` returns a named one); `__check_init__`
        # checks its length.
        self.eig = None if eig is None else cast(tuple[Array, Array], tuple(eig))

    def __check_init__(self):
        size = structure_size(self.structure)
        if self.matrix.shape != (size, size):
            raise ValueError(
                f"`Full(matrix, structure)`: `matrix` has shape {self.matrix.shape}, "
                f"but `structure` {self.structure} has {size} coordinates."
            )
        if self.eig is not None and tuple(x.shape for x in self.eig) != (
            (size,),
            (size, size),
        ):
            raise ValueError(
                "`Full(matrix, structure, eig=...)`: `eig` must be (eigenvalues, "
                f"eigenvectors) of shapes ({size},) and ({size}, {size}), got "
                f"{tuple(x.shape for x in self.eig)}."
            )

    def precompute(self) -> "Full":
        """This block with `eig` filled, for repeated solves and log-determinants.

        **Returns:**

        A `Full` equal to this one, carrying the eigendecomposition of its matrix
        (eigenvalues clamped at zero).
        """
        return Full(self.matrix, self.structure, eig=self._clamped_eigh())

    def _flat(self, vector: Operand) -> Array:
        return ravel(tuple(x.astype(self.matrix.dtype) for x in vector))

    def _out(self, flat: Array) -> Operand:
        # Products are computed in the matrix's dtype (at least float32 for bfloat16
        # models) and returned in the operand's.
        return tuple(
            x.astype(s.dtype)
            for x, s in zip(unravel(flat, self.structure), self.structure)
        )

    def mv(self, vector: Operand) -> Operand:
        check_operand(vector, self.structure, "Full.mv")
        return self._out(self.matrix @ self._flat(vector))

    def as_matrix(self) -> Float[Array, "size size"]:
        return self.matrix

    def in_structure(self) -> Structure:
        return self.structure

    def _cholesky(self, damping: Array) -> Float[Array, "size size"]:
        eye = jnp.eye(self.matrix.shape[0], dtype=self.matrix.dtype)
        return linalg.fallible_cholesky(self.matrix + damping * eye)

    def _clamped_eigh(self) -> tuple[Array, Array]:
        if self.eig is not None:
            values, vectors = self.eig
            return jnp.maximum(values, 0), vectors
        return _clamped_eigh(self.matrix)

    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        check_operand(vector, self.structure, "Full.solve")
        damping = check_damping(damping, self.matrix.dtype)
        flat = self._flat(vector)
        if self.eig is not None:
            return self._out(_eigen_solve(*self._clamped_eigh(), damping, flat))
        factor = self._cholesky(damping)
        return self._out(_solve(factor, self.matrix, damping, flat))

    def diagonal(self) -> Operand:
        return self._out(jnp.diagonal(self.matrix))

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        damping = check_damping(damping, self.matrix.dtype)
        if self.eig is not None:
            return jnp.sum(jnp.log(self._clamped_eigh()[0] + damping))
        factor = self._cholesky(damping)
        ok = jnp.all(jnp.isfinite(factor))
        operands = (factor, self.matrix, damping)
        return jax.lax.cond(ok, _logdet_by_cholesky, _logdet_by_eigh, *operands)

    def trace(self) -> Float[Array, ""]:
        return jnp.trace(self.matrix)

    def eigenvalues(self) -> Float[Array, " size"]:
        if self.eig is not None:
            return self._clamped_eigh()[0]
        return linalg.eigvalsh(self.matrix)

    def ema(self, other: AbstractBlock, decay: ScalarLike) -> "Full":
        other = check_same(self, other, "ema")
        decay = check_scalar(decay, "decay", self.matrix.dtype, upper=1.0)
        matrix = decay * self.matrix + (1 - decay) * other.matrix
        return Full(matrix, self.structure)

    def scale(self, c: ScalarLike) -> "Full":
        c = check_scalar(c, "c", self.matrix.dtype)
        eig = None if self.eig is None else (c * self.eig[0], self.eig[1])
        return Full(c * self.matrix, self.structure, eig=eig)


# The branches of `Full.solve` and `Full.logdet`: a failed Cholesky factor (a
# matrix not positive definite in its precision) falls back to the clamped
# eigendecomposition. Module functions, not closures: `lax.cond` outside `jit`
# then reuses their traces and compiled program, where new closures compiled
# anew at every call (0.2-0.5 s each on a 38 x 38 matrix).
def _solve_by_cholesky(factor, matrix, damping, flat):
    del matrix, damping
    return linalg.cho_solve(factor, flat)


def _solve_by_eigh(factor, matrix, damping, flat):
    del factor
    return _eigen_solve(*_clamped_eigh(matrix), damping, flat)


def _plain_solve(factor, matrix, damping, flat):
    ok = jnp.all(jnp.isfinite(factor))
    operands = (factor, matrix, damping, flat)
    return jax.lax.cond(ok, _solve_by_cholesky, _solve_by_eigh, *operands)


@jax.custom_jvp
def _solve(factor, matrix, damping, flat):
    """`_plain_solve`, whose `jax.vmap` (a stacked layer's blocks) solves by
    Cholesky and computes the eigendecompositions only when a factor failed:
    `vmap` of its `lax.cond` selected between both branches, computing every
    eigendecomposition (5.5x the time of a solve of the same blocks unstacked,
    8 steps of a 2,307-parameter model)."""
    return _batched_solve(factor, matrix, damping, flat)


@_solve.defjvp
def _solve_jvp(primals, tangents):
    # Differentiated as the plain function (`custom_vmap` has no derivative).
    return jax.jvp(_plain_solve, primals, tangents)


@jax.custom_batching.custom_vmap
def _batched_solve(factor, matrix, damping, flat):
    return _plain_solve(factor, matrix, damping, flat)


@_batched_solve.def_vmap
def _batched_solves(axis_size, in_batched, factor, matrix, damping, flat):
    operands = tuple(
        x if batched else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        for x, batched in zip((factor, matrix, damping, flat), in_batched)
    )
    by_cholesky = jax.vmap(_solve_by_cholesky)(*operands)
    ok = jnp.all(jnp.isfinite(operands[0]), axis=(-2, -1))
    out = jax.lax.cond(
        jnp.all(ok), _first, _by_eigh_where_failed, by_cholesky, ok, *operands
    )
    return out, True


def _first(by_cholesky, ok, *operands):
    del ok, operands
    return by_cholesky


def _by_eigh_where_failed(by_cholesky, ok, *operands):
    by_eigh = jax.vmap(_solve_by_eigh)(*operands)
    ok = ok.reshape(ok.shape + (1,) * (by_eigh.ndim - 1))
    return jnp.where(ok, by_cholesky, by_eigh)


def _clamped_eigh(matrix: Array) -> tuple[Array, Array]:
    """The eigendecomposition of `matrix`, negative eigenvalues (rounding) as 0."""
    values, vectors = linalg.eigh(matrix)
    return jnp.maximum(values, 0), vectors


def _eigen_solve(values, vectors, damping, flat) -> Array:
    """`(V diag(values) V^T + damping I)^-1 flat`."""
    return vectors @ ((vectors.T @ flat) / (values + damping))


def _logdet_by_cholesky(factor, matrix, damping):
    del matrix, damping
    return 2 * jnp.sum(jnp.log(jnp.diagonal(factor)))


def _logdet_by_eigh(factor, matrix, damping):
    del factor
    return jnp.sum(jnp.log(jnp.maximum(linalg.eigvalsh(matrix), 0) + damping))
