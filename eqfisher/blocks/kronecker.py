from collections.abc import Sequence
from typing import cast

import equinox as eqx
import jax
import jax.custom_batching
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
from jaxtyping import Array, ArrayLike, Float, ScalarLike

from .. import _host_linalg as host_linalg, _linalg as linalg
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

# A Kronecker factor: a dense symmetric PSD matrix, or the non-negative diagonal of
# a diagonal one (a vector).
Factor = Float[Array, "d d"] | Float[Array, " d"]


def _dense(factor: Factor) -> Float[Array, "d d"]:
    return factor if factor.ndim == 2 else jnp.diag(factor)


def _diagonal(factor: Factor) -> Float[Array, " d"]:
    # Every (d + 1)-th entry of the flattened matrix: `jnp.diagonal` traces a
    # `lax.cond` and a gather, a tenth of a K-FAC step's trace (issue 26).
    return factor.reshape(-1)[:: factor.shape[0] + 1] if factor.ndim == 2 else factor


def stacked_pi_damping_shifts(
    factors: Sequence[tuple[Array, Array]], damping: ScalarLike
) -> list[tuple[Array, Array]]:
    r"""`KroneckerFactored.pi_damping_shifts` of stacks of K-FAC blocks at once.

    `factors` holds each stack's `(a, g)`, with a leading stack axis, `(k, d, d)`
    each (`(k, d)` for a diagonal factor); the result each stack's shifts of A and
    G, `(k,)` each, in A's dtype. The factors' traces are one reduction of their
    zero-padded diagonals and $\pi$ one element-wise computation for all of them:
    a few kernels for every block of a model, not a few per block (issue 26). A
    zero factor gives $\pi = 1$. Computed in float32, float64 where a factor is."""
    if not factors:
        return []
    wide = any(f.dtype == jnp.float64 for pair in factors for f in pair)
    dtype = jnp.float64 if wide else jnp.float32
    root = jnp.sqrt(check_damping(damping, dtype))
    means = []
    for side in (0, 1):
        stacks = [pair[side] for pair in factors]
        width = max(f.shape[-1] for f in stacks)
        diagonals = jnp.concatenate(
            [
                jnp.pad(
                    jax.vmap(_diagonal)(f).astype(dtype),
                    ((0, 0), (0, width - f.shape[-1])),
                )
                for f in stacks
            ]
        )
        dims = np.concatenate([np.full(f.shape[0], f.shape[-1], dtype) for f in stacks])
        means.append(jnp.sum(diagonals, axis=1) / dims)
    pi = jnp.sqrt(means[0] / means[1])
    pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0)
    ends = np.cumsum([a.shape[0] for a, _ in factors])[:-1]
    pieces = zip(jnp.split(pi * root, ends), jnp.split(root / pi, ends))
    return [
        (shift_a.astype(a.dtype), shift_g.astype(a.dtype))
        for (a, _), (shift_a, shift_g) in zip(factors, pieces)
    ]


def _left(factor: Factor, matrix: Array) -> Array:
    """factor @ matrix."""
    return factor @ matrix if factor.ndim == 2 else factor[:, None] * matrix


def _right(matrix: Array, factor: Factor) -> Array:
    """matrix @ factor."""
    return matrix @ factor if factor.ndim == 2 else matrix * factor[None, :]


def _clamped_eigh(factor: Factor) -> Eigh:
    # The factors are PSD; rounding (float32) can leave eigenvalues slightly below
    # zero, and their products with the other factor's below −damping: clamped, every
    # damped inverse and log-determinant stays finite for any positive damping.
    if factor.ndim == 1:
        # Transient identity eigenvectors: every consumer of `a_eig`/`g_eig` works.
        return jnp.maximum(factor, 0), jnp.eye(factor.shape[0], dtype=factor.dtype)
    values, vectors = linalg.eigh(factor)
    return jnp.maximum(values, 0), vectors


def _eigh_inverse(eig: Eigh, shift: Array) -> Array:
    values, vectors = jnp.maximum(eig[0], 0), eig[1]
    return (vectors / (values + shift)[None, :]) @ vectors.T


def _cholesky_inverse(factor: Array, shift: Array) -> Array:
    eye = jnp.eye(factor.shape[0], dtype=factor.dtype)
    chol = linalg.cholesky(factor + shift * eye)
    return linalg.cho_solve(chol, eye)


def _plain_shifted_inverse(factor: Array, shift: Array) -> Array:
    inv = _cholesky_inverse(factor, shift)
    return jax.lax.cond(
        jnp.all(jnp.isfinite(inv)),
        lambda: inv,
        lambda: _eigh_inverse(_clamped_eigh(factor), shift),
    )


@jax.custom_jvp
def _dense_shifted_inverse(factor: Array, shift: Array) -> Array:
    return _batched_shifted_inverse(factor, shift)


@_dense_shifted_inverse.defjvp
def _dense_shifted_inverse_jvp(primals, tangents):
    # Differentiated as the plain function (`custom_vmap` has no derivative).
    return jax.jvp(_plain_shifted_inverse, primals, tangents)


@jax.custom_batching.custom_vmap
def _batched_shifted_inverse(factor: Array, shift: Array) -> Array:
    return _plain_shifted_inverse(factor, shift)


@_batched_shifted_inverse.def_vmap
def _dense_shifted_inverses(axis_size, in_batched, factor, shift):
    # The factors of a stacked layer's steps (`Curvature.runs`): a Cholesky each,
    # and the eigendecompositions only when one of them failed. `vmap` of the
    # `lax.cond` above would select between both branches, computing them always.
    factor, shift = (
        x if batched else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        for x, batched in zip((factor, shift), in_batched)
    )
    inv = jax.vmap(_cholesky_inverse)(factor, shift)
    ok = jnp.all(jnp.isfinite(inv), axis=(-2, -1))

    def fallback():
        by_eigh = jax.vmap(lambda f, s: _eigh_inverse(_clamped_eigh(f), s))
        return jnp.where(ok[:, None, None], inv, by_eigh(factor, shift))

    return jax.lax.cond(jnp.all(ok), lambda: inv, fallback), True


# Factors up to this size share a batched inverse with factors up to twice smaller,
# padded to their size (`shifted_inverses`); larger ones only with factors of their
# own size.
PAD_MAX_DIM = 256

# Factors up to this size are inverted through their clamped eigendecomposition:
# one LAPACK call and no fallback, a quarter of the compile time of a Cholesky
# inverse with its fallback, and at most 0.2 ms slower per factor and refresh
# (benchmarks/RESULTS.md, "Issue 26, second session"). Above it the eigendecomposition
# costs 3-5 times the Cholesky's run time.
EIGH_MAX_DIM = 64


@jax.custom_jvp
def _small_shifted_inverse(factor: Array, shift: Array) -> Array:
    return _eigh_inverse(_clamped_eigh(factor), shift)


@_small_shifted_inverse.defjvp
def _small_shifted_inverse_jvp(primals, tangents):
    # No derivative of `eigh`, which is undefined where eigenvalues repeat.
    inverse = _small_shifted_inverse(*primals)
    return inverse, _inverse_tangent(inverse, *tangents)


def _inverse_tangent(inverse: Array, d_factor: Array, d_shift: Array) -> Array:
    """d(M⁻¹) = −M⁻¹ dM M⁻¹, with M = factor + shift·I, for a matrix or a stack of
    them (`d_shift` then one per matrix); a fallback's clamping taken as fixed."""
    eye = jnp.broadcast_to(
        jnp.eye(inverse.shape[-1], dtype=inverse.dtype), inverse.shape
    )
    d_m = d_factor + jnp.asarray(d_shift)[..., None, None] * eye
    return -inverse @ d_m @ inverse


@jax.custom_jvp
def _kronecker_solve(a: Array, g: Array, matrix: Array, damping: Array) -> Array:
    """X with G X A + damping·X = `matrix`: (G⊗A + λI)⁻¹ in matrix form, through
    the factors' clamped eigendecompositions."""
    return _eigen_solve(_clamped_eigh(a), _clamped_eigh(g), matrix, damping)


def _eigen_solve(a_eig: Eigh, g_eig: Eigh, matrix: Array, damping: Array) -> Array:
    (s_a, q_a), (s_g, q_g) = a_eig, g_eig
    factor = 1 / (s_g[:, None] * s_a[None, :] + damping)
    return rotate_scale(matrix, q_g, q_a, factor)


@_kronecker_solve.defjvp
def _kronecker_solve_jvp(primals, tangents):
    # No derivative of `eigh`, which is undefined (NaN) where eigenvalues repeat
    # (two always-zero inputs): d X = (K + λI)⁻¹ (dM − dG X A − G X dA − dλ X).
    a, g, matrix, damping = primals
    d_a, d_g, d_matrix, d_damping = tangents
    x = _kronecker_solve(a, g, matrix, damping)
    rhs = d_matrix - _left(d_g, _right(x, a)) - _left(g, _right(x, d_a))
    return x, _kronecker_solve(a, g, rhs - d_damping * x, damping)


def _shifted_inverse(factor: Factor, shift: Array, eig: Eigh | None) -> Factor:
    # (factor + shift·I)⁻¹ for a PSD factor and shift > 0: from the cached
    # eigendecomposition when there is one; for a small factor, from its clamped
    # eigendecomposition; else by Cholesky, falling back to the clamped
    # eigendecomposition when rounding makes Cholesky fail (float32).
    if factor.ndim == 1:
        return 1 / (jnp.maximum(factor, 0) + shift)
    if eig is not None:
        return _eigh_inverse(eig, shift)
    return _matrix_inverse(factor.shape[0])(factor, shift)


def _matrix_inverse(size: int):
    """How a matrix factor of `size` is inverted (`_shifted_inverse`)."""
    if size <= EIGH_MAX_DIM:
        return _small_shifted_inverse
    return _dense_shifted_inverse


def shifted_inverses(
    factors: Sequence[Array], shifts: Sequence[Array], on_host: bool | None = None
) -> list[Array]:
    """`(factor + shift·I)⁻¹` of stacks of PSD factors (`_shifted_inverse` on each):
    every factor has a leading stack axis, `(k, d, d)` for matrices, `(k, d)` for
    diagonals, its shifts `(k,)`. The matrices are inverted together: on the host,
    in one callback (`_host_linalg.shifted_inverses`), where `on_host` is True, or
    None and jax's default backend is the CPU; else in XLA, by size class
    (`_class_inverses`). Differentiable either way (on the host by
    `_inverse_tangent`)."""
    matrices = [i for i, f in enumerate(factors) if f.ndim == 3]
    args = [factors[i] for i in matrices], [shifts[i] for i in matrices]
    if not matrices:
        inverses = []
    elif host_linalg.use_host(on_host):
        # One vector of shifts: a single operand, not a buffer per stack.
        wide = any(s.dtype == jnp.float64 for s in args[1])
        dtype = jnp.float64 if wide else jnp.float32
        inverses = _host_inverses(
            args[0], jnp.concatenate([jnp.asarray(s, dtype) for s in args[1]])
        )
    else:
        inverses = _class_inverses(*args)
    out = dict(zip(matrices, inverses))
    return [
        out[i] if i in out else 1 / (jnp.maximum(f, 0) + s[:, None])
        for i, (f, s) in enumerate(zip(factors, shifts))
    ]


@jax.custom_jvp
def _host_inverses(factors: list[Array], shifts: Array) -> list[Array]:
    # A host callback has no derivative of its own.
    return host_linalg.shifted_inverses(factors, shifts)


@_host_inverses.defjvp
def _host_inverses_jvp(primals, tangents):
    inverses = _host_inverses(*primals)
    d_factors, d_shifts = tangents
    ends = np.cumsum([f.shape[0] for f in primals[0]])
    d_shifts = jnp.split(d_shifts, ends[:-1])
    return inverses, [
        _inverse_tangent(inverse, d_factor, d_shift.astype(inverse.dtype))
        for inverse, d_factor, d_shift in zip(inverses, d_factors, d_shifts)
    ]


def _class_inverses(factors: list[Array], shifts: list[Array]) -> list[Array]:
    """`shifted_inverses`'s matrices in XLA (off the CPU), by size class, each
    class in one batched inverse (a Cholesky with the eigendecomposition fallback
    of a stack, or for a class of size at most `EIGH_MAX_DIM` the clamped
    eigendecomposition): a matrix is padded with an identity block to the largest
    size in its class (the padded matrix is block diagonal, so the top-left block
    of its inverse is the factor's), which is at most twice its own, and its own
    above `PAD_MAX_DIM`. One program per size class compiles several times faster
    than one per factor."""
    out: list[Array | None] = [None] * len(factors)
    matrices = sorted(range(len(factors)), key=lambda i: -factors[i].shape[-1])
    while matrices:  # the largest left, and those it pads
        size = factors[matrices[0]].shape[-1]
        least = size if size > PAD_MAX_DIM else (size + 1) // 2
        members = [i for i in matrices if factors[i].shape[-1] >= least]
        matrices = [i for i in matrices if i not in members]
        # Half precisions are inverted in float32 (LAPACK has none below it).
        dtype = jnp.result_type(*(factors[i] for i in members))
        dtype = dtype if jnp.dtype(dtype).itemsize >= 4 else jnp.float32
        padded = jnp.concatenate([_padded(factors[i], size, dtype) for i in members])
        shift = jnp.concatenate([jnp.asarray(shifts[i], dtype) for i in members])
        inverses = jax.vmap(_matrix_inverse(size))(padded, shift)
        start = 0
        for i in members:
            k, d = factors[i].shape[:2]
            out[i] = inverses[start : start + k, :d, :d].astype(factors[i].dtype)
            start += k
    return cast(list[Array], out)


def _padded(factors: Array, size: int, dtype) -> Array:
    """Each of the stacked `factors` in the top-left corner of a `size`-square
    identity."""
    k, d = factors.shape[:2]
    eye = jnp.broadcast_to(jnp.eye(size, dtype=dtype), (k, size, size))
    return eye.at[:, :d, :d].set(factors.astype(dtype))


class KroneckerFactored(AbstractBlock):
    r"""A K-FAC block $B = G \otimes A$ (Martens & Grosse, 2015).

    The operand is `(weight,)` or `(weight, bias)`, seen as the matrix
    M = [transpose(weight, weight_perm).reshape(d_out, d_in), bias.reshape(d_out, 1)]
    (the bias column only with a bias). B acts on the row-major vec of M, i.e.
    `mv(M) = G @ M @ A`; `as_matrix()` is in the ravel order of the operand tuple.
    For `eqx.nn.Linear` (weight `(out, in)`) `weight_perm=(0, 1)`; for `x @ w` with
    `w` of shape `(in, out)`, `weight_perm=(1, 0)`; for a convolution kernel
    `(out, in, *kernel)`, `weight_perm=(0, 1, 2, ...)` and d_in = in·prod(kernel).

    **Fields:**

    - `a`: the input factor A, symmetric PSD, `(d_in', d_in')`; d_in' = d_in + 1
        with a bias, whose homogeneous coordinate is last. Or a diagonal factor,
        stored as its diagonal `(d_in',)` (`KFAC(max_factor_dim=...)`).
    - `g`: the output factor G, symmetric PSD, `(d_out, d_out)`, or its diagonal
        `(d_out,)`.
    - `weight_perm`: static; the first axes of `transpose(weight, weight_perm)`
        whose sizes multiply to d_out = `g.shape[0]` are the output axes.
    - `structure`: static; the operand, `(weight,)` or `(weight, bias)`, as
        `jax.ShapeDtypeStruct`s. Products are computed in the factors' dtype and
        returned in the operand's.
    - `a_eig`, `g_eig`: `None`, or `(eigenvalues, eigenvectors)` of `a` and `g`
        from `precompute()` (eigenvalues clamped at zero: rounding can leave a PSD
        factor's smallest ones slightly negative); `solve`, `pi_damped_inverse`, `logdet` and `eigenvalues`
        reuse them instead of calling `jnp.linalg.eigh`.

    `eigenvalues()` is `outer(eig(G), eig(A)).ravel()` (unsorted).

    !!! Example

        ```python
        a = jnp.array([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 1.0]])  # A: 3 inputs
        g = jnp.array([[1.0, 0.5], [0.5, 1.0]])  # G: 2 outputs
        weight = jnp.zeros((2, 3))  # eqx.nn.Linear(3, 2, use_bias=False): (out, in)
        block = ef.blocks.KroneckerFactored(a, g, weight_perm=(0, 1), structure=(weight,))
        assert jnp.allclose(block.as_matrix(), jnp.kron(g, a))  # B = G ⊗ A

        m = jnp.arange(6.0).reshape(2, 3)
        (bm,) = block.mv((m,))
        assert jnp.allclose(bm, g @ m @ a)  # B vec(M) = vec(G M A)
        print(block.eigenvalues())  # eig(G) = {0.5, 1.5} times eig(A) = {1, 1, 3}
        ```
    """

    averages_batches = True  # `ema` averages each factor

    a: Float[Array, "d_in d_in"] | Float[Array, " d_in"]
    g: Float[Array, "d_out d_out"] | Float[Array, " d_out"]
    weight_perm: tuple[int, ...] = eqx.field(static=True)
    structure: Structure = eqx.field(static=True)
    a_eig: tuple[Float[Array, " d_in"], Float[Array, "d_in d_in"]] | None
    g_eig: tuple[Float[Array, " d_out"], Float[Array, "d_out d_out"]] | None

    def __init__(
        self,
        a: Float[ArrayLike, "d_in d_in"] | Float[ArrayLike, " d_in"],
        g: Float[ArrayLike, "d_out d_out"] | Float[ArrayLike, " d_out"],
        *,
        weight_perm: tuple[int, ...],
        structure: tuple[object, ...],
        a_eig: tuple[Float[Array, " d_in"], Float[Array, "d_in d_in"]] | None = None,
        g_eig: tuple[Float[Array, " d_out"], Float[Array, "d_out d_out"]] | None = None,
    ):
        """**Arguments:**

        - `a`, `g`: the Kronecker factors A `(d_in', d_in')` and G `(d_out, d_out)`;
            a vector stands for a diagonal factor.
        - `weight_perm`: how the weight's axes map to the matrix view (see above).
        - `structure`: the operand leaves `(weight,)` or `(weight, bias)`, as arrays
            or `jax.ShapeDtypeStruct`s.
        - `a_eig`, `g_eig`: optional precomputed `jnp.linalg.eigh` of `a` and `g`
            (for a diagonal factor: its diagonal and the identity).
        """
        self.a = jnp.asarray(a)
        self.g = jnp.asarray(g)
        self.weight_perm = tuple(int(i) for i in weight_perm)
        self.structure = normalise_structure(structure)
        # Plain tuples (`jnp.linalg.eigh` returns a named one).
        self.a_eig = None if a_eig is None else cast(Eigh, tuple(a_eig))
        self.g_eig = None if g_eig is None else cast(Eigh, tuple(g_eig))

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
            a_eig=a_eig,
            g_eig=g_eig,
        )

    def mv(self, vector: Operand) -> Operand:
        return self._operand(_left(self.g, _right(self._matrix(vector, "mv"), self.a)))

    def as_matrix(self) -> Float[Array, "size size"]:
        kron = jnp.kron(_dense(self.g), _dense(self.a))
        return to_operand_order(kron, self.weight_perm, self.structure, self.g.shape[0])

    def solve(self, vector: Operand, damping: ScalarLike) -> Operand:
        matrix = self._matrix(vector, "solve")
        damping = check_damping(damping, self.a.dtype)
        if self.a_eig is None or self.g_eig is None:
            return self._operand(_kronecker_solve(self.a, self.g, matrix, damping))
        return self._operand(_eigen_solve(*self._eighs(), matrix, damping))

    def pi_damped_inverse(self, damping: ScalarLike) -> "KroneckerFactored":
        r"""Martens & Grosse's factored Tikhonov damping, inverted: a Kronecker block.

        With $\pi = \sqrt{(\operatorname{tr}(A) / d_A) / (\operatorname{tr}(G) / d_G)}$,
        returns

        $$
        \Bigl(G + \frac{\sqrt\lambda}{\pi} I\Bigr)^{-1}
        \otimes \bigl(A + \pi \sqrt\lambda\, I\bigr)^{-1}.
        $$

        Its `mv` is the π-damped solve, two matrix products. A zero factor (a layer
        that saw no data) gives $\pi = 0$ or $\infty$; $\pi$ is then 1. This is not
        $(B + \lambda I)^{-1}$; use `solve` for the exact damped inverse.

        **Arguments:**

        - `damping`: $\lambda$, a positive scalar.

        **Returns:**

        A `KroneckerFactored` with the same layout, holding the two damped inverses.
        """
        shift_a, shift_g = self.pi_damping_shifts(damping)
        return KroneckerFactored(
            _shifted_inverse(self.a, shift_a, self.a_eig),
            _shifted_inverse(self.g, shift_g, self.g_eig),
            weight_perm=self.weight_perm,
            structure=self.structure,
        )

    def pi_damping_shifts(self, damping: ScalarLike) -> tuple[Array, Array]:
        r"""The shifts $\pi\sqrt\lambda$ of A and $\sqrt\lambda / \pi$ of G in
        `pi_damped_inverse`, as scalar arrays."""
        ((shift_a, shift_g),) = stacked_pi_damping_shifts(
            [(self.a[None], self.g[None])], damping
        )
        return shift_a[0], shift_g[0]

    def solve_factored(self, vector: Operand, damping: ScalarLike) -> Operand:
        r"""The π-damped approximate solve: `pi_damped_inverse(damping).mv(vector)`.

        Computes
        $(G + \frac{\sqrt\lambda}{\pi} I)^{-1} M (A + \pi \sqrt\lambda\, I)^{-1}$ (see
        `pi_damped_inverse`). This is not $(B + \lambda I)^{-1} v$; use `solve` for
        the exact damped inverse.

        **Arguments:**

        - `vector`: a tuple of arrays shaped like the operand.
        - `damping`: $\lambda$, a positive scalar.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        check_operand(vector, self.structure, "KroneckerFactored.solve_factored")
        return self.pi_damped_inverse(damping).mv(vector)

    def diagonal(self) -> Operand:
        diag = _diagonal(self.g)[:, None] * _diagonal(self.a)[None, :]
        return self._operand(diag)

    def logdet(self, damping: ScalarLike) -> Float[Array, ""]:
        damping = check_damping(damping, self.a.dtype)
        return jnp.sum(jnp.log(self.eigenvalues() + damping))

    def trace(self) -> Float[Array, ""]:
        return jnp.sum(_diagonal(self.g)) * jnp.sum(_diagonal(self.a))

    def eigenvalues(self) -> Float[Array, " size"]:
        (s_a, _), (s_g, _) = self._eighs()
        return (s_g[:, None] * s_a[None, :]).ravel()

    def ema(self, other: AbstractBlock, decay: ScalarLike) -> "KroneckerFactored":
        """Averages each factor: `decay·A + (1 − decay)·A'`, likewise G.

        This is the usual K-FAC practice; it is not the average of the Kronecker
        products. The result carries no eigendecompositions (call `precompute`).

        **Arguments:**

        - `other`: a `KroneckerFactored` with the same layout (the new estimate).
        - `decay`: a scalar in [0, 1]; the weight of `self`.

        **Returns:**

        A `KroneckerFactored`.
        """
        other = check_same(self, other, "ema")
        if other.weight_perm != self.weight_perm:
            raise ValueError(
                "`KroneckerFactored.ema(other, ...)`: `other` has weight_perm "
                f"{other.weight_perm}, this block {self.weight_perm}."
            )
        if (other.a.ndim, other.g.ndim) != (self.a.ndim, self.g.ndim):
            raise ValueError(
                "`KroneckerFactored.ema(other, ...)`: `other` has factors of "
                f"dimensions {(other.a.ndim, other.g.ndim)} (1: diagonal), this block "
                f"{(self.a.ndim, self.g.ndim)}."
            )
        decay = check_scalar(decay, "decay", self.a.dtype, upper=1.0)
        return KroneckerFactored(
            decay * self.a + (1 - decay) * other.a,
            decay * self.g + (1 - decay) * other.g,
            weight_perm=self.weight_perm,
            structure=self.structure,
        )

    def scale(self, c: ScalarLike) -> "KroneckerFactored":
        r"""$cB$, stored as $(cG) \otimes A$; eigendecompositions are kept, rescaled."""
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
