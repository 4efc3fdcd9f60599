import jax
import jax.core
import jax.numpy as jnp
import lineax as lx
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
    ravel,
)


class DiagonalBlock(AbstractBlock):
    """A diagonal curvature block.

    **Fields:**

    - `diag`: the diagonal of B as a tuple of non-negative arrays, one per operand
        leaf and shaped like it. The operand structure is read from it.

    `eigenvalues` are the ravelled diagonal (operand order, unsorted).

    !!! Example

        ```python
        # A 3 → 1 layer: weight (1, 3), bias (1,); `structure=ef.Diagonal()` builds these.
        block = ef.blocks.DiagonalBlock((jnp.array([[1.0, 2.0, 3.0]]), jnp.array([4.0])))
        v = (jnp.ones((1, 3)), jnp.ones(1))
        print(block.solve(v, 1.0))  # 1 / (d + 1): [[0.5, 0.333, 0.25]], [0.2]
        print(block.logdet(1.0))  # log(2·3·4·5) = log 120 ≈ 4.787
        ```
    """

    averages_batches = True  # `ema` averages the diagonals

    diag: tuple[Float[Array, "..."], ...]

    def __init__(self, diag: tuple[Float[ArrayLike, "..."], ...]):
        """**Arguments:**

        - `diag`: the diagonal of B, a tuple of arrays shaped like the operand.
        """
        self.diag = tuple(jnp.asarray(d) for d in diag)

    def __check_init__(self):
        if len(self.diag) == 0:
            raise ValueError(
                "`DiagonalBlock(diag)`: `diag` must have at least one leaf."
            )
        dtypes = {x.dtype for x in self.diag}
        if len(dtypes) != 1:
            raise ValueError(
                f"`DiagonalBlock(diag)`: the leaves of `diag` must share one dtype, got "
                f"{sorted(str(d) for d in dtypes)}."
            )
        # A concrete diagonal is checked (a traced one, built by eqfisher from
        # squares, is not): a negative entry gave NaN log-determinants and
        # infinite solves.
        concrete = [d for d in self.diag if not isinstance(d, jax.core.Tracer)]
        if any(bool(jnp.any(d < 0)) for d in concrete):
            raise ValueError(
                "`DiagonalBlock(diag)`: a curvature's diagonal must be "
                "non-negative; `diag` has negative entries."
            )

    def mv(self, vector: Operand) -> Operand:
        check_operand(vector, self.in_structure(), "DiagonalBlock.mv")
        # Computed in the diagonal's dtype, returned in the operand's (bfloat16 models).
        return tuple(
            (d * x.astype(d.dtype)).astype(x.dtype)
            for d, x in zip(self.diag, vector, strict=True)
        )

    def as_matrix(self) -> Float[Array, "size size"]:
        return jnp.diag(ravel(self.diag))

    def in_structure(self) -> Structure:
        return normalise_structure(self.diag)

    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        check_operand(vector, self.in_structure(), "DiagonalBlock.solve")
        damping = check_damping(damping, self.diag[0].dtype)
        return tuple(
            (x.astype(d.dtype) / (d + damping)).astype(x.dtype)
            for d, x in zip(self.diag, vector, strict=True)
        )

    def diagonal(self) -> Operand:
        return self.diag

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        damping = check_damping(damping, self.diag[0].dtype)
        return jnp.sum(jnp.log(ravel(self.diag) + damping))

    def trace(self) -> Float[Array, ""]:
        return jnp.sum(ravel(self.diag))

    def eigenvalues(self) -> Float[Array, " size"]:
        return ravel(self.diag)

    def ema(self, other: AbstractBlock, decay: ScalarLike) -> "DiagonalBlock":
        other = check_same(self, other, "ema")
        decay = check_scalar(decay, "decay", self.diag[0].dtype, upper=1.0)
        return DiagonalBlock(
            tuple(
                decay * d + (1 - decay) * e
                for d, e in zip(self.diag, other.diag, strict=True)
            )
        )

    def scale(self, c: ScalarLike) -> "DiagonalBlock":
        c = check_scalar(c, "c", self.diag[0].dtype)
        return DiagonalBlock(tuple(c * d for d in self.diag))


@lx.is_diagonal.register(DiagonalBlock)
@lx.is_tridiagonal.register(DiagonalBlock)
@lx.is_lower_triangular.register(DiagonalBlock)
@lx.is_upper_triangular.register(DiagonalBlock)
def _(operator):
    return True


@lx.tridiagonal.register(DiagonalBlock)
def _(operator):
    diag = ravel(operator.diag)
    off = jnp.zeros(diag.shape[0] - 1, diag.dtype)
    return diag, off, off
