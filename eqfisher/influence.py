r"""Influence functions: how up-weighting a training example changes a query's loss.

For a model trained on the mean loss $L(\theta) = \frac{1}{N} \sum_n \ell_n(\theta)$,
the score of training example $t$ on query $q$ is

$$
\operatorname{score}(q, t)
= \nabla \ell_q(\theta)^\top (H + \lambda I)^{-1} \nabla \ell_t(\theta),
$$

with $H$ a curvature of the mean loss (identity, diagonal, K-FAC, EKFAC, or the exact
GGN by conjugate gradients). Removing $t$ moves the parameters by
$\approx \frac{1}{N} (H + \lambda I)^{-1} \nabla \ell_t$, so the query loss changes by
$\approx +\operatorname{score}/N$: a positive score marks a *helpful* example
(up-weighting it lowers the query loss), as in kronfluence; Koh & Liang's
$\mathcal{I}_{\text{up,loss}}$ is $-\operatorname{score}$.
"""

import abc
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import optax
from jaxtyping import Array, Float, PyTree, ScalarLike

from . import _linalg as linalg, _refusal, filters
from ._curvature import Curvature
from ._products import linearised
from .blocks._base import check_damping


__all__ = [
    "AbstractInverse",
    "ConjugateGradient",
    "CurvatureInverse",
    "Identity",
    "influence_scores",
    "self_influence",
]


class AbstractInverse(eqx.Module):
    r"""A damped inverse curvature $(H + \lambda I)^{-1}$ applied to gradient PyTrees.

    !!! Example

        ```python
        class Scaled(ef.influence.AbstractInverse):  # H = 0: (λ·I)⁻¹
            damping: float

            def solve(self, vector):
                return jax.tree.map(lambda v: v / self.damping, vector)

        scaled = ef.influence.self_influence(loss_fn, model, batch, Scaled(2.0))
        plain = ef.influence.self_influence(loss_fn, model, batch, ef.influence.Identity())
        assert jnp.allclose(scaled, plain / 2.0)
        ```
    """

    def operand_structure(self) -> PyTree | None:
        """The structure (`jax.ShapeDtypeStruct` leaves) of the gradients `solve`
        takes, for `influence_scores` and `self_influence` to check against the
        gradients of the parameters `where=` selects; `None` (the default) for an
        inverse that takes any."""
        return None

    @abc.abstractmethod
    def solve(self, vector: PyTree) -> PyTree:
        r"""$(H + \lambda I)^{-1} v$.

        **Arguments:**

        - `vector`: a gradient PyTree (unselected parameters `None`).

        **Returns:**

        A PyTree like `vector`.
        """


class Identity(AbstractInverse):
    r"""$H = 0$, $\lambda = 1$: scores are plain gradient dot products.

    This is TracIn at one point.

    !!! Example

        ```python
        scores = ef.influence.self_influence(
            loss_fn, model, batch, ef.influence.Identity()
        )
        # With no curvature, an example's self-influence is its squared gradient norm.
        g0 = eqx.filter_grad(loss_fn)(model, (x[:1], y[:1]))
        print(scores[0], sum(jnp.vdot(g, g) for g in jax.tree.leaves(g0)))  # equal
        ```
    """

    def solve(self, vector: PyTree) -> PyTree:
        return vector


class CurvatureInverse(AbstractInverse):
    r"""$(C + \lambda I)^{-1}$ through a `Curvature`'s exact block solves.

    It uses `Curvature.solve`.

    **Fields:**

    - `curvature`: a `Curvature` of the mean training loss (`Diagonal()`, `KFAC()`,
        `EKFAC()`, `Dense()`, ...), over the same `where` as the gradients.
    - `damping`: $\lambda > 0$.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        inverse = ef.influence.CurvatureInverse(curv, 0.1)
        v = inverse.solve(grads)  # (C + 0.1·I)⁻¹ g
        back = jax.tree.map(lambda cv, vi: cv + 0.1 * vi, curv.mv(v), v)
        for p, g in zip(jax.tree.leaves(back), jax.tree.leaves(grads)):
            assert jnp.allclose(p, g, rtol=1e-3, atol=1e-6)
        ```
    """

    curvature: Curvature
    damping: Float[Array, ""]

    def __init__(self, curvature: Curvature, damping: ScalarLike):
        if not isinstance(curvature, Curvature):
            raise TypeError(
                "`eqfisher.influence.CurvatureInverse(curvature, damping)` takes a "
                "`Curvature` (from `eqfisher.curvature`), got "
                f"{type(curvature).__name__}. For a matrix-free operator (such as "
                "`eqfisher.ggn_operator`'s) use `ConjugateGradient(operator, "
                "damping)`; for a dense matrix, `ConjugateGradient("
                "lineax.MatrixLinearOperator(matrix, lineax.symmetric_tag), damping)`."
            )
        self.curvature = curvature
        self.damping = _checked_damping(damping, "CurvatureInverse")

    def operand_structure(self) -> PyTree:
        return self.curvature.in_structure()

    def solve(self, vector: PyTree) -> PyTree:
        return self.curvature.solve(vector, self.damping)


class ConjugateGradient(AbstractInverse):
    r"""$(H + \lambda I)^{-1}$ by `lineax.CG` on a matrix-free operator, e.g. the
    exact GGN `eqfisher.ggn_operator(loss_fn, model, train)`.

    The system is solved as $(H/\lambda + I)\, x = v/\lambda$, whose eigenvalues are
    at least 1: lineax's CG breakdown test ($p^\top A p$ against
    $100 \cdot \varepsilon \cdot \text{size} \cdot r^\top r$) then never trips in
    float32, whatever the scale of $H$.

    **Fields:**

    - `operator`: a symmetric PSD lineax operator over the gradients' PyTree.
    - `damping`: $\lambda > 0$.
    - `rtol`, `atol`, `max_steps`: for `lineax.CG` (`atol` relative to
      $\lVert v \rVert_\infty / \lambda$).

    !!! Example

        ```python
        # Usually on the exact GGN (`ggn` in the setup); here on a K-FAC curvature,
        # to compare with its exact block solves.
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        by_cg = ef.influence.ConjugateGradient(curv, 0.1).solve(grads)
        exact = ef.influence.CurvatureInverse(curv, 0.1).solve(grads)
        for p, q in zip(jax.tree.leaves(by_cg), jax.tree.leaves(exact)):
            assert jnp.allclose(p, q, rtol=1e-3, atol=1e-5)
        ```
    """

    operator: lx.AbstractLinearOperator
    damping: Float[Array, ""]
    rtol: float | int = eqx.field(static=True)
    atol: float | int = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)

    def __init__(
        self,
        operator: lx.AbstractLinearOperator,
        damping: ScalarLike,
        *,
        rtol: float | int = 1e-6,
        atol: float | int = 1e-6,
        max_steps: int = 1000,
    ):
        if not isinstance(operator, lx.AbstractLinearOperator):
            raise TypeError(
                "`eqfisher.influence.ConjugateGradient(operator, damping)` takes a "
                "lineax operator (`eqfisher.ggn_operator(...)`, a `Curvature`), got "
                f"{type(operator).__name__}; wrap a dense matrix as "
                "`lineax.MatrixLinearOperator(matrix, lineax.symmetric_tag)`."
            )
        for name, value in (("rtol", rtol), ("atol", atol)):
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(
                    f"`eqfisher.influence.ConjugateGradient(..., {name}=...)`: a "
                    f"finite number >= 0, got {value!r}."
                )
        _refusal.check_count(
            max_steps, "max_steps", "eqfisher.influence.ConjugateGradient"
        )
        self.operator = operator
        self.damping = _checked_damping(damping, "ConjugateGradient")
        self.rtol = rtol
        self.atol = atol
        self.max_steps = max_steps

    def operand_structure(self) -> PyTree:
        return self.operator.in_structure()

    def solve(self, vector: PyTree) -> PyTree:
        leaves = jax.tree_util.tree_leaves(vector)
        dtypes = sorted({jnp.dtype(x.dtype).name for x in leaves})
        if len(dtypes) > 1 or jnp.finfo(leaves[0].dtype).bits < 32:
            # Half precision never met the tolerances (products rounded at 1e-3:
            # "did not converge" whatever they were), and mixed dtypes gave
            # lineax's "Closure-converted function called with different dynamic
            # arguments".
            raise TypeError(
                "`eqfisher.influence.ConjugateGradient`: CG needs parameters of one "
                f"dtype of at least 32 bits, got {dtypes}. Build the operator and "
                "the gradients from the model cast to float32, or use "
                "`CurvatureInverse` (exact for its structure, in any precision)."
            )
        dtype = leaves[0].dtype
        inv = (1 / self.damping).astype(dtype)
        operator = linearised(self.operator)  # one forward pass, not one a step

        def damped_mv(v):
            return jax.tree_util.tree_map(lambda a, b: inv * a + b, operator.mv(v), v)

        # Its own product, not lineax's `inv * operator + identity`: lineax sums a
        # diagonal operator's diagonal (a `Diagonal()` curvature's) with the
        # identity's float64 one under x64, and CG then refuses a float32 vector.
        damped = lx.FunctionLinearOperator(
            damped_mv,
            operator.in_structure(),
            (lx.symmetric_tag, lx.positive_semidefinite_tag),
        )
        b = jax.tree_util.tree_map(lambda x: inv * x, vector)
        # lineax stops when every residual component is below atol + rtol·|b_i|:
        # atol is taken relative to the largest component of b.
        scale = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves])) * inv
        # `lineax.CG.atol` is annotated `float` but is a dynamic field: an array works.
        # A tolerance needs no derivative, and lineax refuses a solver that has one
        # ("Unexpected tangent"): `jax.grad` in the damping or the query failed.
        atol = self.atol * jax.lax.stop_gradient(scale)
        solver = lx.CG(rtol=self.rtol, atol=atol, max_steps=self.max_steps)  # pyright: ignore[reportArgumentType]
        solution = lx.linear_solve(damped, b, solver, throw=False)
        # Not converged in `max_steps`: refused, not returned as if solved (3
        # steps gave scores 8% off, silently).
        return eqx.error_if(
            solution.value,
            solution.result != lx.RESULTS.successful,
            "`eqfisher.influence.ConjugateGradient`: CG did not converge to "
            "`rtol`/`atol` within `max_steps`; raise `max_steps` or `damping`, or "
            "loosen `rtol`/`atol`.",
        )


def _checked_damping(damping: ScalarLike, caller: str) -> Array:
    """`damping` as a scalar array, checked positive by the blocks' own check (now
    if it is concrete, at run time if traced), the error naming `caller`. At 0,
    CG on a singular curvature returned zeros, silently."""
    try:
        return check_damping(damping, jnp.result_type(damping))
    except ValueError as e:
        raise ValueError(f"`eqfisher.influence.{caller}(..., damping)`: {e}") from None


def _check_call(caller: str, inverse, batches: dict, sizes: dict) -> None:
    """The arguments of `influence_scores` / `self_influence`: an `AbstractInverse`,
    batches whose leaves share a leading example axis, positive chunk sizes."""
    if not isinstance(inverse, AbstractInverse):
        raise TypeError(
            f"`eqfisher.influence.{caller}(..., inverse)`: an "
            "`eqfisher.influence.AbstractInverse` (`Identity()`, "
            "`CurvatureInverse(curvature, damping)`, `ConjugateGradient(operator, "
            f"damping)`), got {type(inverse).__name__}."
        )
    for name, value in sizes.items():
        if value is not None:
            _refusal.check_count(value, name, f"eqfisher.influence.{caller}")
    for name, batch in batches.items():
        leaves = jax.tree_util.tree_leaves(batch)
        shapes = [tuple(jnp.shape(x)) for x in leaves]
        counts = {shape[0] for shape in shapes if shape}
        if not leaves or () in shapes or len(counts) != 1:
            raise ValueError(
                f"`eqfisher.influence.{caller}(..., {name}, ...)`: every leaf of "
                f"`{name}` needs one leading example axis of a common size (the "
                "scores are per example; one example is `x[None]`), got leaves "
                f"shaped {shapes}."
            )


def _gradient_fn(loss_fn: Callable, model: PyTree, where, caller: str) -> Callable:
    """`example -> ∇ℓ(example)` over the selected parameters (others `None`)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    if where is None:
        selected = jax.tree_util.tree_map(lambda p: True, params)
    else:
        try:
            selected = filters.optax_mask(model, where)
        except ValueError as e:
            e.add_note(f"(from `eqfisher.influence.{caller}(..., where=...)`)")
            raise
    theta = jax.tree_util.tree_map(lambda p, s: p if s else None, params, selected)
    rest = jax.tree_util.tree_map(lambda p, s: None if s else p, params, selected)

    def grad(example):
        one = jax.tree_util.tree_map(lambda a: a[None], example)
        loss = lambda t: loss_fn(eqx.combine(t, rest, static), one)
        return jax.grad(loss)(theta)

    return grad


def _solved(inverse: AbstractInverse, vector: PyTree, caller: str) -> PyTree:
    """`inverse.solve(vector)`, refused (while tracing) unless it is a PyTree like
    `vector`: a transposed leaf gave scores of another shape, and `None` or a
    flat vector JAX's errors."""
    out = inverse.solve(vector)
    same = jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(vector)
    want = [jnp.shape(x) for x in jax.tree_util.tree_leaves(vector)]
    got = [jnp.shape(x) for x in jax.tree_util.tree_leaves(out)]
    if not same or got != want:
        raise ValueError(
            f"`eqfisher.influence.{caller}`: `{type(inverse).__name__}.solve(vector)` "
            "must return a PyTree like `vector` (a gradient, leaves shaped "
            f"{want}), got leaves shaped {got}"
            f"{'' if same else ' in another structure'}."
        )
    return out


def _check_operand(
    inverse: AbstractInverse, grad: Callable, batch: PyTree, caller: str
) -> None:
    """Refuses gradients of other parameters than `inverse` takes (a curvature
    built with `where=` and scores without it, or the other way round)."""
    expected = inverse.operand_structure()
    if expected is None:
        return
    got = jax.eval_shape(grad, jax.tree_util.tree_map(lambda a: a[0], batch))

    def shapes(tree) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x in jax.tree_util.tree_leaves(tree)]

    def listed(tree) -> str:
        leaves = shapes(tree)
        more = f", and {len(leaves) - 4} more" if len(leaves) > 4 else ""
        return f"{len(leaves)} leaves ({', '.join(map(str, leaves[:4]))}{more})"

    if shapes(got) != shapes(expected):
        raise ValueError(
            f"`eqfisher.influence.{caller}(..., inverse, where=...)`: `inverse` "
            f"takes the gradients of {listed(expected)}, but the parameters "
            f"`where=` selects (all of them without `where=`) are {listed(got)}. "
            "Pass the `where=` the curvature (or operator) was built with."
        )
    # Leaves of the same shapes may still be other leaves (two layers alike).
    paths, want = _selected_paths(got), _selected_paths(expected)
    if len(paths) == len(want) and paths != want:
        held = lambda entries: [p for p in entries if p is not None]  # noqa: E731
        raise ValueError(
            f"`eqfisher.influence.{caller}(..., inverse, where=...)`: `inverse` "
            f"takes the gradients of {held(want)}, but `where=` selects "
            f"{held(paths)} (leaves of the same shapes). Pass the `where=` the "
            "curvature (or operator) was built with."
        )


def _selected_paths(tree: PyTree) -> list[str | None]:
    """The path of each leaf `tree` holds, `None` where a parameter is left out."""
    entries = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return [None if x is None else jax.tree_util.keystr(p) for p, x in entries]


def _low_rank(x: Array, rank: int | None):
    """A matrix leaf as rank-`rank` factors `(U·S, V)` (truncated SVD); others kept."""
    if rank is None or x.ndim != 2:
        return x
    u, s, vt = linalg.svd(x)
    return (u[:, :rank] * s[None, :rank], vt[:rank].T)


def _factored_dot(factored: list, g: PyTree) -> Float[Array, ""]:
    total = 0
    for f, y in zip(factored, jax.tree_util.tree_leaves(g)):
        if isinstance(f, tuple):
            total = total + jnp.einsum("ir,ij,jr->", f[0], y, f[1])
        else:
            total = total + jnp.vdot(f, y)
    return jnp.asarray(total)


def influence_scores(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    train: PyTree,
    query: PyTree,
    inverse: AbstractInverse,
    *,
    where=None,
    chunk_size: int | None = None,
    query_chunk_size: int | None = None,
    query_rank: int | None = None,
) -> Float[Array, "queries examples"]:
    r"""Pairwise scores $\nabla \ell_q^\top (H + \lambda I)^{-1} \nabla \ell_t$ for
    every query $q$ and training example $t$.

    The query gradients are preconditioned once (`query_chunk_size` at a time);
    training gradients are then formed `chunk_size` examples at a time and paired
    with them, so memory is (queries + chunk_size)·P for P selected parameters.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar`; called on batches of one.
    - `model`: the trained model.
    - `train`, `query`: batches (PyTrees with a leading example axis).
    - `inverse`: `Identity()`, `CurvatureInverse(curvature, damping)` or
        `ConjugateGradient(operator, damping)`.
    - `where`: a filter (`eqfisher.filters`) restricting the parameters; must be
        the `where` the curvature was built with.
    - `chunk_size`, `query_chunk_size`: examples per vectorised step (default:
        all at once).
    - `query_rank`: keep each preconditioned query gradient's matrix leaves
        (d_out, d_in) as rank-`query_rank` truncated SVDs (kronfluence's low-rank
        query gradients): query memory per matrix leaf r·(d_out + d_in) instead of
        d_out·d_in. `None` (default) keeps them exact.

    **Returns:**

    Scores of shape `(num_queries, num_train)`.

    **Raises:**

    `ValueError` when `query_rank` is not a positive integer or `None`, or
    `inverse` takes the gradients of other parameters than `where` selects; the
    errors of `loss_fn` on a batch of one (every leaf of `train` and `query` needs a
    leading example axis).

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        query = (x[:2], y[:2])
        scores = ef.influence.influence_scores(
            loss_fn, model, batch, query, ef.influence.CurvatureInverse(curv, 1e-3)
        )
        print(scores.shape)  # (2, 32): every query against every training example
        ```
    """
    sizes = {"chunk_size": chunk_size, "query_chunk_size": query_chunk_size}
    sizes["query_rank"] = query_rank
    _check_call("influence_scores", inverse, {"train": train, "query": query}, sizes)
    # A check that fails in the compiled call (CG not converged) is raised as
    # Equinox's error.
    with _refusal.checks_surfaced():
        return _scores(loss_fn, model, train, query, inverse, where, **sizes)


# Compiled, with the functions it passes to `lax.map` made inside: called outside
# `jit`, each `lax.map` of a new closure was compiled again at every call.
@eqx.filter_jit
def _scores(
    loss_fn,
    model,
    train,
    query,
    inverse,
    where,
    chunk_size,
    query_chunk_size,
    query_rank,
):
    grad = _gradient_fn(loss_fn, model, where, "influence_scores")
    _check_operand(inverse, grad, query, "influence_scores")  # raised when traced

    def precondition(q):
        leaves = jax.tree_util.tree_leaves(
            _solved(inverse, grad(q), "influence_scores")
        )
        return [_low_rank(x, query_rank) for x in leaves]

    def row(example):
        g = grad(example)
        return jax.vmap(lambda s: _factored_dot(s, g))(solved)

    solved = jax.lax.map(precondition, query, batch_size=query_chunk_size)
    return jax.lax.map(row, train, batch_size=chunk_size).T


def self_influence(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    train: PyTree,
    inverse: AbstractInverse,
    *,
    where=None,
    chunk_size: int | None = None,
) -> Float[Array, " examples"]:
    r"""$\nabla \ell_t^\top (H + \lambda I)^{-1} \nabla \ell_t$ for every training
    example $t$ (outlier and mislabel detection), `chunk_size` examples at a time.

    **Arguments:**

    - `loss_fn`, `model`, `train`, `inverse`, `where`, `chunk_size`: as for
        `influence_scores`.

    **Returns:**

    Scores of shape `(num_train,)`.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        inverse = ef.influence.CurvatureInverse(curv, 0.1)
        scores = ef.influence.self_influence(loss_fn, model, batch, inverse)
        print(scores.shape, jnp.argmax(scores))  # (32,) and the most self-influential
        # The diagonal of the pairwise scores of the training set with itself.
        pairs = ef.influence.influence_scores(loss_fn, model, batch, batch, inverse)
        assert jnp.allclose(scores, jnp.diagonal(pairs), rtol=1e-4)
        ```
    """
    _check_call("self_influence", inverse, {"train": train}, {"chunk_size": chunk_size})
    with _refusal.checks_surfaced():  # as in `influence_scores`
        return _self_scores(loss_fn, model, train, inverse, where, chunk_size)


@eqx.filter_jit  # as `_scores`
def _self_scores(loss_fn, model, train, inverse, where, chunk_size):
    grad = _gradient_fn(loss_fn, model, where, "self_influence")
    _check_operand(inverse, grad, train, "self_influence")  # raised when traced

    def one(example):
        g = grad(example)
        return optax.tree_utils.tree_vdot(g, _solved(inverse, g, "self_influence"))

    return jax.lax.map(one, train, batch_size=chunk_size)
