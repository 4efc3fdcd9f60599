import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, ScalarLike

from ._base import (
    AbstractBlock,
    Operand,
    Structure,
    check_damping,
    check_operand,
    check_same,
    check_scalar,
    normalise_structure,
)
from ._layout import (
    check_layout,
    from_matrix,
    rotate_scale,
    to_matrix,
    to_operand_order,
)


# Eigenvalues and eigenvectors, as returned by `jnp.linalg.eigh`.
Eigh = tuple[Array, Array]


def _clamped_eigh(factor: Float[Array, "d d"]) -> Eigh:
    # The factors are PSD; rounding (float32) can leave eigenvalues slightly below
    # zero, and their products with the other factor's below −damping: clamped, every
    # damped inverse and log-determinant stays finite for any positive damping.
    values, vectors = jnp.linalg.eigh(factor)
    return jnp.maximum(values, 0), vectors


class KroneckerFactored(AbstractBlock):
    """A K-FAC block B = G ⊗ A (Martens & Grosse, 2015).

    The operand is `(weight,)` or `(weight, bias)`, seen as the matrix
    M = [transpose(weight, weight_perm).reshape(d_out, d_in), bias.reshape(d_out, 1)]
    (the bias column only with a bias). B acts on the row-major vec of M, i.e.
    `mv(M) = G @ M @ A`; `as_matrix()` is in the ravel order of the operand tuple.
    For `eqx.nn.Linear` (weight `(out, in)`) `weight_perm=(0, 1)`; for `x @ w` with
    `w` of shape `(in, out)`, `weight_perm=(1, 0)`; for a convolution kernel
    `(out, in, *kernel)`, `weight_perm=(0, 1, 2, ...)` and d_in = in·prod(kernel).

    **Fields:**

    - `a`: the input factor A, symmetric PSD, `(d_in', d_in')`; d_in' = d_in + 1
        with a bias, whose homogeneous coordinate is last.
    - `g`: the output factor G, symmetric PSD, `(d_out, d_out)`.
    - `weight_perm`: static; the first axes of `transpose(weight, weight_perm)`
        whose sizes multiply to d_out = `g.shape[0]` are the output axes.
    - `structure`: static; the operand, `(weight,)` or `(weight, bias)`, as
        `jax.ShapeDtypeStruct`s. Products are computed in the factors' dtype and
        returned in the operand's.
    - `a_eig`, `g_eig`: `None`, or `(eigenvalues, eigenvectors)` of `a` and `g`
        from `precompute()` (eigenvalues clamped at zero: rounding can leave a PSD
        factor's smallest ones slightly negative); `solve`, `solve_factored`, `logdet` and `eigenvalues`
        reuse them instead of calling `jnp.linalg.eigh`.

    `eigenvalues()` is `outer(eig(G), eig(A)).ravel()` (unsorted).
    """

    a: Float[Array, "d_in d_in"]
    g: Float[Array, "d_out d_out"]
    weight_perm: tuple[int, ...] = eqx.field(static=True)
    structure: Structure = eqx.field(static=True)
    a_eig: tuple[Float[Array, " d_in"], Float[Array, "d_in d_in"]] | None
    g_eig: tuple[Float[Array, " d_out"], Float[Array, "d_out d_out"]] | None

    def __init__(
        self,
        a: Float[ArrayLike, "d_in d_in"],
        g: Float[ArrayLike, "d_out d_out"],
        *,
        weight_perm: tuple[int, ...],
        structure: tuple[object, ...],
        a_eig: tuple[Float[Array, " d_in"], Float[Array, "d_in d_in"]] | None = None,
        g_eig: tuple[Float[Array, " d_out"], Float[Array, "d_out d_out"]] | None = None,
    ):
        """**Arguments:**

        - `a`, `g`: the Kronecker factors A `(d_in', d_in')` and G `(d_out, d_out)`.
        - `weight_perm`: how the weight's axes map to the matrix view (see above).
        - `structure`: the operand leaves `(weight,)` or `(weight, bias)`, as arrays
            or `jax.ShapeDtypeStruct`s.
        - `a_eig`, `g_eig`: optional precomputed `jnp.linalg.eigh` of `a` and `g`.
        """
        self.a = jnp.asarray(a)
        self.g = jnp.asarray(g)
        self.weight_perm = tuple(int(i) for i in weight_perm)
        self.structure = normalise_structure(structure)
        self.a_eig = None if a_eig is None else tuple(a_eig)
        self.g_eig = None if g_eig is None else tuple(g_eig)

    def __check_init__(self):
        check_layout(
            "KroneckerFactored",
            self.weight_perm,
            self.structure,
            self.g.shape[0],
            self.a.shape[0],
            "g",
            "a",
        )
        if self.a.dtype != self.g.dtype:
            raise ValueError(
                f"`KroneckerFactored`: `a` ({self.a.dtype}) and `g` ({self.g.dtype}) "
                "must have the same dtype."
            )
        if (self.a_eig is None) != (self.g_eig is None):
            raise ValueError(
                "`KroneckerFactored`: pass both `a_eig` and `g_eig`, or neither."
            )

    def in_structure(self) -> Structure:
        return self.structure

    def _matrix(self, vector: Operand, method: str) -> Float[Array, "d_out d_in"]:
        check_operand(vector, self.structure, f"KroneckerFactored.{method}")
        vector = tuple(x.astype(self.a.dtype) for x in vector)
        return to_matrix(vector, self.weight_perm, self.g.shape[0])

    def _operand(self, matrix: Float[Array, "d_out d_in"]) -> Operand:
        out = from_matrix(matrix, self.weight_perm, self.structure)
        return tuple(
            x.astype(s.dtype) for x, s in zip(out, self.structure, strict=True)
        )

    def _eighs(self) -> tuple[Eigh, Eigh]:
        if self.a_eig is not None and self.g_eig is not None:
            (s_a, q_a), (s_g, q_g) = self.a_eig, self.g_eig
            return (jnp.maximum(s_a, 0), q_a), (jnp.maximum(s_g, 0), q_g)
        return _clamped_eigh(self.a), _clamped_eigh(self.g)

    def precompute(self) -> "KroneckerFactored":
        """This block with `a_eig` and `g_eig` filled, for repeated solves.

        **Returns:**

        A `KroneckerFactored` equal to this one, carrying the eigendecompositions.
        """
        a_eig, g_eig = self._eighs()
        return KroneckerFactored(
            self.a,
            self.g,
            weight_perm=self.weight_perm,
            structure=self.structure,
            a_eig=tuple(a_eig),
            g_eig=tuple(g_eig),
        )

    def mv(self, vector: Operand) -> Operand:
        return self._operand(self.g @ self._matrix(vector, "mv") @ self.a)

    def as_matrix(self) -> Float[Array, "size size"]:
        kron = jnp.kron(self.g, self.a)
        return to_operand_order(kron, self.weight_perm, self.structure, self.g.shape[0])

    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        matrix = self._matrix(vector, "solve")
        damping = check_damping(damping, self.a.dtype)
        (s_a, q_a), (s_g, q_g) = self._eighs()
        factor = 1 / (s_g[:, None] * s_a[None, :] + damping)
        return self._operand(rotate_scale(matrix, q_g, q_a, factor))

    def solve_factored(self, vector: Operand, damping: ScalarLike) -> Operand:
        """Martens & Grosse's factored Tikhonov damping: an approximate solve.

        Computes (G + (√λ/π)·I)⁻¹ M (A + π√λ·I)⁻¹, i.e. the inverse of
        (G + (√λ/π)·I) ⊗ (A + π√λ·I), with π = √((tr(A)/d_A) / (tr(G)/d_G)).
        This is not (B + λ·I)⁻¹ v; use `solve` for the exact damped inverse.

        **Arguments:**

        - `vector`: a tuple of arrays shaped like the operand.
        - `damping`: λ, a positive scalar.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        matrix = self._matrix(vector, "solve_factored")
        damping = check_damping(damping, self.a.dtype)
        (s_a, q_a), (s_g, q_g) = self._eighs()
        pi = jnp.sqrt(jnp.mean(s_a) / jnp.mean(s_g))
        root = jnp.sqrt(damping)
        factor = 1 / ((s_g + root / pi)[:, None] * (s_a + pi * root)[None, :])
        return self._operand(rotate_scale(matrix, q_g, q_a, factor))

    def diagonal(self) -> Operand:
        diag = jnp.diagonal(self.g)[:, None] * jnp.diagonal(self.a)[None, :]
        return self._operand(diag)

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        damping = check_damping(damping, self.a.dtype)
        return jnp.sum(jnp.log(self.eigenvalues() + damping))

    def trace(self) -> Float[Array, ""]:
        return jnp.trace(self.g) * jnp.trace(self.a)

    def eigenvalues(self) -> Float[Array, " size"]:
        (s_a, _), (s_g, _) = self._eighs()
        return (s_g[:, None] * s_a[None, :]).ravel()

    def ema(self, other: "KroneckerFactored", decay: ScalarLike) -> "KroneckerFactored":
        """Averages each factor: `decay·A + (1 − decay)·A'`, likewise G.

        This is the usual K-FAC practice; it is not the average of the Kronecker
        products. The result carries no eigendecompositions (call `precompute`).

        **Arguments:**

        - `other`: a `KroneckerFactored` with the same layout (the new estimate).
        - `decay`: a scalar in [0, 1]; the weight of `self`.

        **Returns:**

        A `KroneckerFactored`.
        """
        check_same(self, other, "ema")
        if other.weight_perm != self.weight_perm:
            raise ValueError(
                "`KroneckerFactored.ema(other, ...)`: `other` has weight_perm "
                f"{other.weight_perm}, this block {self.weight_perm}."
            )
        decay = check_scalar(decay, "decay", self.a.dtype, upper=1.0)
        return KroneckerFactored(
            decay * self.a + (1 - decay) * other.a,
            decay * self.g + (1 - decay) * other.g,
            weight_perm=self.weight_perm,
            structure=self.structure,
        )

    def scale(self, c: ScalarLike) -> "KroneckerFactored":
        """c·B, stored as (c·G) ⊗ A; eigendecompositions are kept, rescaled."""
        c = check_scalar(c, "c", self.a.dtype)
        g_eig = None if self.g_eig is None else (c * self.g_eig[0], self.g_eig[1])
        return KroneckerFactored(
            self.a,
            c * self.g,
            weight_perm=self.weight_perm,
            structure=self.structure,
            a_eig=self.a_eig,
            g_eig=g_eig,
        )
