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
from .kronecker import KroneckerFactored


class EigenKroneckerFactored(AbstractBlock):
    r"""An EKFAC block (George et al., 2018): K-FAC's eigenbasis, rescaled.

    On the row-major vec of the matrix view $M$ of the operand,

    $$
    B = (Q_G \otimes Q_A) \operatorname{diag}(\operatorname{vec}(\text{scales}))
    (Q_G \otimes Q_A)^\top,
    $$

    that is, `mv(M) = Q_G [scales ∘ (Q_Gᵀ M Q_A)] Q_Aᵀ`. The matrix view is that of
    [`eqfisher.blocks.KroneckerFactored`][]: the operand is `(weight,)` or
    `(weight, bias)`, with the bias as the last column.

    **Fields:**

    - `q_a`: orthonormal eigenvectors (columns) of the K-FAC input factor A,
        `(d_in', d_in')`.
    - `q_g`: orthonormal eigenvectors (columns) of the K-FAC output factor G,
        `(d_out, d_out)`.
    - `scales`: the non-negative eigenvalues of B, `(d_out, d_in')`; entry (k, l)
        belongs to the eigenvector `q_g[:, k] ⊗ q_a[:, l]`. In EKFAC they are the
        diagonal of the true curvature in that basis (see `ekfac_from_kronecker`).
    - `weight_perm`, `structure`: static; as for `KroneckerFactored`.

    `eigenvalues()` is `scales.ravel()` (unsorted). All of `solve`, `logdet`,
    `diagonal` are exact for this B.

    !!! Example

        ```python
        q_a, _ = jnp.linalg.qr(jax.random.normal(key, (3, 3)))  # orthonormal bases
        q_g, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (2, 2)))
        scales = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # (d_out, d_in)
        weight = jnp.zeros((2, 3))  # no bias: d_in' = d_in = 3
        block = ef.blocks.EigenKroneckerFactored(
            q_a, q_g, scales, weight_perm=(0, 1), structure=(weight,)
        )
        print(jnp.linalg.eigvalsh(block.as_matrix()))  # 1, 2, ..., 6: the scales
        print(block.logdet(1.0), jnp.sum(jnp.log(scales + 1)))  # equal
        ```
    """

    q_a: Float[Array, "d_in d_in"]
    q_g: Float[Array, "d_out d_out"]
    scales: Float[Array, "d_out d_in"]
    weight_perm: tuple[int, ...] = eqx.field(static=True)
    structure: Structure = eqx.field(static=True)

    def __init__(
        self,
        q_a: Float[ArrayLike, "d_in d_in"],
        q_g: Float[ArrayLike, "d_out d_out"],
        scales: Float[ArrayLike, "_d_out _d_in"],
        *,
        weight_perm: tuple[int, ...],
        structure: tuple[object, ...],
    ):
        """**Arguments:**

        - `q_a`, `q_g`: the eigenbases, orthonormal columns.
        - `scales`: the eigenvalues, `(d_out, d_in')`.
        - `weight_perm`, `structure`: the layout, as for `KroneckerFactored`.
        """
        self.q_a = jnp.asarray(q_a)
        self.q_g = jnp.asarray(q_g)
        self.scales = jnp.asarray(scales)
        self.weight_perm = tuple(int(i) for i in weight_perm)
        self.structure = normalise_structure(structure)

    def __check_init__(self):
        check_layout(
            "EigenKroneckerFactored",
            self.weight_perm,
            self.structure,
            self.q_g.shape[0],
            self.q_a.shape[0],
            "q_g",
            "q_a",
        )
        if self.scales.shape != (self.q_g.shape[0], self.q_a.shape[0]):
            raise ValueError(
                f"`EigenKroneckerFactored`: `scales` has shape {self.scales.shape}, "
                f"expected {(self.q_g.shape[0], self.q_a.shape[0])} (d_out, d_in')."
            )
        if not self.q_a.dtype == self.q_g.dtype == self.scales.dtype:
            raise ValueError(
                "`EigenKroneckerFactored`: `q_a`, `q_g` and `scales` must share "
                "one dtype."
            )

    def in_structure(self) -> Structure:
        return self.structure

    def _matrix(self, vector: Operand, method: str) -> Float[Array, "d_out d_in"]:
        check_operand(vector, self.structure, f"EigenKroneckerFactored.{method}")
        vector = tuple(x.astype(self.scales.dtype) for x in vector)
        return to_matrix(vector, self.weight_perm, self.q_g.shape[0])

    def _operand(self, matrix: Float[Array, "d_out d_in"]) -> Operand:
        out = from_matrix(matrix, self.weight_perm, self.structure)
        return tuple(
            x.astype(s.dtype) for x, s in zip(out, self.structure, strict=True)
        )

    def mv(self, vector: Operand) -> Operand:
        matrix = self._matrix(vector, "mv")
        return self._operand(rotate_scale(matrix, self.q_g, self.q_a, self.scales))

    def as_matrix(self) -> Float[Array, "size size"]:
        basis = jnp.kron(self.q_g, self.q_a)
        dense = (basis * self.scales.ravel()[None, :]) @ basis.T
        return to_operand_order(
            dense, self.weight_perm, self.structure, self.q_g.shape[0]
        )

    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        matrix = self._matrix(vector, "solve")
        damping = check_damping(damping, self.scales.dtype)
        factor = 1 / (self.scales + damping)
        return self._operand(rotate_scale(matrix, self.q_g, self.q_a, factor))

    def diagonal(self) -> Operand:
        return self._operand(self.q_g**2 @ self.scales @ (self.q_a**2).T)

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        damping = check_damping(damping, self.scales.dtype)
        return jnp.sum(jnp.log(self.scales + damping))

    def trace(self) -> Float[Array, ""]:
        return jnp.sum(self.scales)

    def eigenvalues(self) -> Float[Array, " size"]:
        return self.scales.ravel()

    def ema(self, other: AbstractBlock, decay: ScalarLike) -> "EigenKroneckerFactored":
        """Averages the scales, `decay·scales + (1 − decay)·other.scales`.

        The result takes `other`'s eigenbases (the newer estimate), as in EKFAC,
        where scales are re-estimated in the current basis; it is therefore not
        the average of the two matrices unless the bases agree.

        **Arguments:**

        - `other`: an `EigenKroneckerFactored` with the same layout.
        - `decay`: a scalar in [0, 1]; the weight of `self`.

        **Returns:**

        An `EigenKroneckerFactored`.
        """
        other = check_same(self, other, "ema")
        if other.weight_perm != self.weight_perm:
            raise ValueError(
                "`EigenKroneckerFactored.ema(other, ...)`: `other` has weight_perm "
                f"{other.weight_perm}, this block {self.weight_perm}."
            )
        decay = check_scalar(decay, "decay", self.scales.dtype, upper=1.0)
        return EigenKroneckerFactored(
            other.q_a,
            other.q_g,
            decay * self.scales + (1 - decay) * other.scales,
            weight_perm=self.weight_perm,
            structure=self.structure,
        )

    def scale(self, c: ScalarLike) -> "EigenKroneckerFactored":
        c = check_scalar(c, "c", self.scales.dtype)
        return EigenKroneckerFactored(
            self.q_a,
            self.q_g,
            c * self.scales,
            weight_perm=self.weight_perm,
            structure=self.structure,
        )


def ekfac_from_kronecker(
    block: KroneckerFactored,
    per_example_matrices: Float[Array, "n d_out d_in"],
) -> EigenKroneckerFactored:
    r"""The EKFAC block in the eigenbasis of a K-FAC block.

    With per-example gradients $M_n$ in the matrix view (the bias as the last
    column), scaled so that the true curvature is
    $\sum_n \operatorname{vec}(M_n) \operatorname{vec}(M_n)^\top$, the scales are
    $\sum_n (Q_G^\top M_n Q_A)^2$: the diagonal of the true curvature in the basis
    $Q_G \otimes Q_A$. For a mean over $N$ examples, pass $M_n / \sqrt{N}$.

    **Arguments:**

    - `block`: a `KroneckerFactored` block; its eigendecompositions are used if
        precomputed, else computed.
    - `per_example_matrices`: shape `(n, d_out, d_in')`, in the factors' layout.

    **Returns:**

    An `EigenKroneckerFactored` with the layout of `block`.

    !!! Example

        ```python
        # A 3 → 2 layer without bias over 16 examples: Mₙ = gₙ aₙᵀ / √16.
        g_n = jax.random.normal(key, (16, 2))  # output gradients
        a_n = jax.random.normal(jax.random.key(1), (16, 3))  # inputs
        m = g_n[:, :, None] * a_n[:, None, :] / 4.0
        kfac = ef.blocks.KroneckerFactored(
            a_n.T @ a_n / 16, g_n.T @ g_n / 16,
            weight_perm=(0, 1), structure=(jnp.zeros((2, 3)),),
        )
        ekfac = ef.blocks.ekfac_from_kronecker(kfac, m)
        true = m.reshape(16, 6).T @ m.reshape(16, 6)  # Σₙ vec(Mₙ) vec(Mₙ)ᵀ
        # EKFAC keeps the true curvature's diagonal in its eigenbasis, so its trace;
        # K-FAC's trace, tr(G)·tr(A), differs.
        print(ekfac.trace(), jnp.trace(true), kfac.trace())
        ```
    """
    expected = (block.g.shape[0], block.a.shape[0])
    if per_example_matrices.shape[1:] != expected:
        raise ValueError(
            "`ekfac_from_kronecker(block, per_example_matrices)`: "
            f"`per_example_matrices` has shape {per_example_matrices.shape}, "
            f"expected (n, {expected[0]}, {expected[1]})."
        )
    block = block.precompute()
    assert block.a_eig is not None and block.g_eig is not None  # precompute fills them
    q_a, q_g = block.a_eig[1], block.g_eig[1]
    matrices = per_example_matrices.astype(q_a.dtype)
    rotated = jnp.einsum("ik,nkl,lj->nij", q_g.T, matrices, q_a)
    return EigenKroneckerFactored(
        q_a,
        q_g,
        jnp.sum(rotated**2, axis=0),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )
