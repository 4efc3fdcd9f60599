"""How the K-FAC preconditioner damps the curvature: damping variants as types.

A damping variant turns one curvature block and a damping λ into the block's damped
inverse, itself a block (`precompute`, once per refresh of the cached inverses);
preconditioning is then that block's `mv` (every step).
"""

import abc
import functools
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ScalarLike

from .. import _linalg as linalg
from .._curvature import Curvature
from ..blocks import (
    AbstractBlock,
    DiagonalBlock,
    EigenKroneckerFactored,
    Full,
    KroneckerFactored,
)
from ..blocks.kronecker import shifted_inverses


class AbstractDamping(eqx.Module):
    r"""A way to damp and invert a curvature block for preconditioning.

    `kfac`, `kfac_preconditioner` take one as `damping_variant=`: `Tikhonov()`,
    `FactoredTikhonov()`, or a subclass implementing `precompute`.

    !!! Example

        A variant that damps twice as much as `Tikhonov()`; the preconditioned
        gradient after one curvature estimate is $(C + 2\lambda I)^{-1} g$:

        ```python
        class DoubleTikhonov(ef.optim.AbstractDamping):
            def precompute(self, block, damping):
                return ef.optim.tikhonov_inverse(block, 2 * damping)

        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        opt = ef.optim.kfac_preconditioner(
            like=curv,
            damping=0.1,
            damping_variant=DoubleTikhonov(),
            norm_constraint=None,
        )
        direction, _ = opt.update(grads, opt.init(params), params, curvature=curv)
        expected = curv.solve(grads, 0.2)
        for a, b in zip(jax.tree.leaves(direction), jax.tree.leaves(expected)):
            assert jnp.allclose(a, b, atol=1e-5)
        ```
    """

    @abc.abstractmethod
    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        r"""The damped inverse of `block`, as a block whose `mv` preconditions.

        **Arguments:**

        - `block`: a curvature block.
        - `damping`: $\lambda > 0$.

        **Returns:**

        A block with the same operand structure.
        """

    def invert(self, curvature: Curvature, damping: ScalarLike) -> Curvature:
        """Every block's `precompute`: the damped inverse of a whole `Curvature`
        (the optimiser's cached inverse). A variant may override it to share work
        between blocks."""
        return curvature.map_blocks(lambda b: self.precompute(b, damping))


@functools.singledispatch
def tikhonov_inverse(block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
    r"""$(B + \lambda I)^{-1}$ as a block (exact for the block type).

    A `functools.singledispatch` function: `tikhonov_inverse.register` adds a block
    type.

    **Raises:**

    `TypeError` for a block type nothing was registered for.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        block = curv.blocks["layers[1]"]  # G ⊗ A over 3 x 9 parameters
        inverse = ef.optim.tikhonov_inverse(block, 0.1)  # an EigenKroneckerFactored
        dense = jnp.linalg.inv(block.as_matrix() + 0.1 * jnp.eye(27))
        assert jnp.allclose(inverse.as_matrix(), dense, atol=1e-4)
        ```
    """
    raise TypeError(
        f"`eqfisher.optim.tikhonov_inverse(block, ...)`: no damped inverse for a "
        f"`{type(block).__name__}` block; register one for that type with "
        "`eqfisher.optim.tikhonov_inverse.register`."
    )


@tikhonov_inverse.register
def _(block: KroneckerFactored, damping):
    # (G ⊗ A + λI)⁻¹ = (Q_G ⊗ Q_A) diag(1 / (s_G s_Aᵀ + λ)) (Q_G ⊗ Q_A)ᵀ.
    block = block if block.a_eig is not None else block.precompute()
    assert block.a_eig is not None and block.g_eig is not None  # both, or neither
    (s_a, q_a), (s_g, q_g) = block.a_eig, block.g_eig
    damping = jnp.asarray(damping).astype(q_a.dtype)
    scales = 1 / (jnp.maximum(s_g, 0)[:, None] * jnp.maximum(s_a, 0)[None, :] + damping)
    return EigenKroneckerFactored(
        q_a,
        q_g,
        scales.astype(q_a.dtype),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )


@tikhonov_inverse.register
def _(block: EigenKroneckerFactored, damping):
    damping = jnp.asarray(damping).astype(block.scales.dtype)
    return EigenKroneckerFactored(
        block.q_a,
        block.q_g,
        (1 / (jnp.maximum(block.scales, 0) + damping)).astype(block.scales.dtype),
        weight_perm=block.weight_perm,
        structure=block.structure,
    )


@tikhonov_inverse.register
def _(block: DiagonalBlock, damping):
    damping = jnp.asarray(damping).astype(block.diag[0].dtype)
    return DiagonalBlock(tuple((1 / (jnp.maximum(d, 0) + damping)) for d in block.diag))


@tikhonov_inverse.register
def _(block: Full, damping):
    damping = jnp.asarray(damping).astype(block.matrix.dtype)
    values, vectors = linalg.eigh(block.matrix)
    inverse = (vectors / (jnp.maximum(values, 0) + damping)[None, :]) @ vectors.T
    return Full(inverse, block.structure)


@functools.singledispatch
def _factored_inverse(block: AbstractBlock, damping):
    return tikhonov_inverse(block, damping)


@_factored_inverse.register
def _(block: KroneckerFactored, damping):
    return block.pi_damped_inverse(damping)


@functools.singledispatch
def _inverted_together(block: AbstractBlock) -> bool:
    """Whether `FactoredTikhonov.invert` inverts the block's factors with the other
    blocks': a K-FAC block without cached eigendecompositions."""
    return False


@_inverted_together.register
def _(block: KroneckerFactored) -> bool:
    return block.a_eig is None and block.g_eig is None


class Tikhonov(AbstractDamping):
    r"""Exact damping: $(B + \lambda I)^{-1}$ for every block.

    For K-FAC blocks, from the factors' eigendecompositions (an EKFAC-shaped block
    with scales $1 / (s_G s_A + \lambda)$); four matrix products per layer and step.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        B = curv.blocks["layers[0]"].as_matrix()  # (40, 40)
        lam = jnp.asarray(0.1)  # λ, a scalar array
        inverse = ef.optim.Tikhonov().precompute(curv.blocks["layers[0]"], lam)
        identity = inverse.as_matrix() @ (B + 0.1 * jnp.eye(40))
        assert jnp.allclose(identity, jnp.eye(40), atol=1e-4)

        opt = ef.optim.kfac(0.1, like=curv, damping_variant=ef.optim.Tikhonov())
        ```
    """

    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        return tikhonov_inverse(block, damping)


class FactoredTikhonov(AbstractDamping):
    r"""Martens & Grosse's π-damping for K-FAC blocks; exact damping for the others.

    A K-FAC block $G \otimes A$ becomes

    $$
    \Bigl(G + \frac{\sqrt\lambda}{\pi} I\Bigr)^{-1}
    \otimes \bigl(A + \pi \sqrt\lambda\, I\bigr)^{-1}
    $$

    (`KroneckerFactored.pi_damped_inverse`): two Cholesky inverses per refresh and
    two matrix products per layer and step. It damps directions where both factors
    are small much more than $\lambda I$ does.

    !!! Example

        The formula above, by hand:

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        block = curv.blocks["layers[0]"]  # A: (5, 5), G: (8, 8)
        A, G, lam = block.a, block.g, jnp.asarray(0.1)
        pi = jnp.sqrt((jnp.trace(A) / 5) / (jnp.trace(G) / 8))
        inverse = ef.optim.FactoredTikhonov().precompute(block, lam)  # Kronecker too
        G_inv = jnp.linalg.inv(G + jnp.sqrt(lam) / pi * jnp.eye(8))
        A_inv = jnp.linalg.inv(A + pi * jnp.sqrt(lam) * jnp.eye(5))
        assert jnp.allclose(inverse.g, G_inv, rtol=1e-4, atol=1e-4)
        assert jnp.allclose(inverse.a, A_inv, rtol=1e-4, atol=1e-4)
        ```
    """

    def precompute(self, block: AbstractBlock, damping: ScalarLike) -> AbstractBlock:
        return _factored_inverse(block, damping)

    def invert(self, curvature: Curvature, damping: ScalarLike) -> Curvature:
        """As `precompute` on every block, with the factors of all K-FAC blocks
        (those of stacked layers too) inverted together, by size class
        (`blocks.kronecker.shifted_inverses`): one program per size class instead
        of one per factor."""
        stacked = {run[0] for run in curvature.runs}
        together = {
            k: cast(KroneckerFactored, b)
            for k, b in curvature.stored.items()
            if _inverted_together(b)
        }
        rest = [k for k in curvature.stored if k not in together]
        out = curvature.map_blocks(lambda b: self.precompute(b, damping), rest)
        factors, shifts = [], []
        for name, b in together.items():
            if name not in stacked:  # a stack of one
                b = jax.tree_util.tree_map(lambda x: x[None], b)
            factors += [b.a, b.g]
            shifts += jax.vmap(lambda b: b.pi_damping_shifts(damping))(b)
        inverses = iter(shifted_inverses(factors, shifts))
        stored = dict(out.stored)
        for name, b in together.items():

            def block(a, g, b=b):
                return KroneckerFactored(
                    a, g, weight_perm=b.weight_perm, structure=b.structure
                )

            new = jax.vmap(block)(next(inverses), next(inverses))
            if name not in stacked:
                new = jax.tree_util.tree_map(lambda x: x[0], new)
            stored[name] = new
        return eqx.tree_at(lambda c: c.stored, out, stored)
