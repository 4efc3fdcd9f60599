"""Adaptive K-FAC (Martens & Grosse 2015, §6–7): learning rate and momentum from the
exact quadratic model, and Levenberg–Marquardt damping from its reduction ratio.

Meant for large batches: the quadratic model is that of one batch, so with small
batches its noise makes the chosen step sizes noisy too.
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import optax
from jaxtyping import Array, Float, Int, PyTree, ScalarLike

from .._products import ggn_operator
from ._state import branch, float_type


class QuadraticModel:
    """The exact Gauss-Newton quadratic model of `loss_fn` on one batch.

    Build it inside the training step with `quadratic_model(loss_fn, model, batch)`
    and pass it to the adaptive K-FAC update as `quadratic=`. Products with the GGN
    go through the public `eqfisher.ggn_operator` (one JVP and one VJP each).

    !!! Example

        `gram` against the dense GGN:

        ```python
        from jax.flatten_util import ravel_pytree

        quadratic = ef.optim.quadratic_model(loss_fn, model, batch)
        gram = quadratic.gram([grads, params])  # (2, 2)
        G = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense()
        ).as_matrix()
        V = jnp.stack([ravel_pytree(grads)[0], ravel_pytree(params)[0]], axis=1)
        assert jnp.allclose(gram, V.T @ G @ V, rtol=1e-4)
        ```
    """

    def __init__(self, loss_fn: Callable, model: PyTree, batch: PyTree):
        # Linearised once: each product is then one JVP and one VJP.
        self._ggn = lx.linearise(ggn_operator(loss_fn, model, batch))
        self.params, self._static = eqx.partition(model, eqx.is_inexact_array)
        self._loss_fn, self._batch = loss_fn, batch

    def gram(self, vectors: list[PyTree]) -> Float[Array, "k k"]:
        r"""$v_i^\top G v_j$ for the exact GGN $G$, from one GGN product per vector.
        A vector of some of the parameters (the others `None`, or optax's
        `MaskedNode` under `optax.masked`) is zero on the others."""
        whole = [self._complete(v, jnp.zeros_like) for v in vectors]
        return _vdots(whole, [self._ggn.mv(v) for v in whole])

    def loss(self, params: PyTree) -> Float[Array, ""]:
        """`loss_fn` on the batch, at other parameters (where some are given, as
        in `gram`, the others at the model's)."""
        whole = self._complete(params, lambda p: p)
        return self._loss_fn(eqx.combine(whole, self._static), self._batch)

    def _complete(self, part: PyTree, fill: Callable) -> PyTree:
        """`part` with `fill(p)` for each parameter `p` it leaves out: adaptive
        K-FAC on a `where=` subset (`optax.masked`, Adam on the rest) is given
        only the subset's leaves."""
        holes, treedef = jax.tree_util.tree_flatten(part, is_leaf=_hole)
        full, full_def = jax.tree_util.tree_flatten(self.params, is_leaf=_hole)
        if treedef != full_def:
            raise ValueError(
                "adaptive K-FAC: the updates, gradients and parameters must have "
                "the structure of `eqx.filter(model, eqx.is_inexact_array)` of the "
                "model given to `quadratic_model` (a subset's leaves `None` or "
                "optax's `MaskedNode`)."
            )
        leaves = [
            fill(p) if _hole(h) and p is not None else None if _hole(h) else h
            for h, p in zip(holes, full)
        ]
        return jax.tree_util.tree_unflatten(full_def, leaves)


def quadratic_model(loss_fn: Callable, model: PyTree, batch: PyTree) -> QuadraticModel:
    """The exact quadratic model of `loss_fn(model, batch)` for adaptive K-FAC.

    Returns a `QuadraticModel`; see `kfac_adaptive` for its use in a training step.

    !!! Example

        ```python
        quadratic = ef.optim.quadratic_model(loss_fn, model, batch)
        assert jnp.allclose(quadratic.loss(quadratic.params), loss_fn(model, batch))
        halved = jax.tree.map(lambda p: p / 2, quadratic.params)
        print(quadratic.loss(halved))  # the loss with every parameter halved
        ```
    """
    return QuadraticModel(loss_fn, model, batch)


class AdaptiveState(NamedTuple):
    """State added by `adaptive_steps`: the damping, the last update, counters."""

    damping: Float[Array, ""]
    previous: PyTree
    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    rho: Float[Array, ""]


def adaptive_steps(
    *,
    initial_damping: float | int,
    adapt_every: int = 5,
    weight_decay: ScalarLike = 0.0,
    min_damping: float | int = 1e-8,
    max_damping: float | int = 1e3,
) -> optax.GradientTransformationExtraArgs:
    """Turns a preconditioned direction Δ into the update αΔ + μδ₋₁ that minimises
    the damped quadratic model, and adapts the damping by its reduction ratio.

    The objective is the loss plus `weight_decay`/2·‖θ‖² (its curvature adds
    `weight_decay`·I); the model over the step is that curvature plus λI, and the
    reduction ratio compares the objective's change with the undamped model's, as
    Martens & Grosse (2015, §6.5) and kfac_jax do. Expects the incoming updates to
    be −(C + (λ + weight_decay)I)⁻¹g for the damping λ it keeps in its state
    (`kfac_adaptive` wires this up), `grads=` the objective's gradient, and
    `quadratic=` (a `QuadraticModel`) the loss's.
    """
    omega = (19.0 / 20.0) ** adapt_every

    def init(params):
        return _initial_state(params, initial_damping)

    def update(updates, state, params=None, *, quadratic=None, grads=None, **extra):
        del extra
        if not isinstance(quadratic, QuadraticModel) or grads is None:
            raise ValueError(
                "adaptive K-FAC needs `quadratic=eqfisher.optim.quadratic_model(loss_fn,"
                " model, batch)` in `update(...)` (`eqfisher.optim.kfac_step` "
                "gives it one)."
            )
        delta, prev = updates, state.previous
        vectors = [delta, prev]
        curvature = quadratic.gram(vectors)
        norms = _vdots(vectors, vectors).astype(curvature.dtype)
        b = _vdots([grads], vectors)[0].astype(curvature.dtype)
        undamped = curvature + weight_decay * norms  # the objective's curvature
        alpha, mu = _coefficients(undamped + state.damping * norms, b)
        # In the coefficients' precision, then each leaf's own dtype: a bfloat16
        # leaf's step came out float32, and the state's `previous` with it.
        step = jax.tree.map(
            lambda d, p: (
                alpha * d.astype(alpha.dtype) + mu * p.astype(alpha.dtype)
            ).astype(p.dtype),
            delta,
            prev,
        )
        # M(δ) − M(0) of the undamped model: bᵀc + ½ cᵀ A c.
        c = jnp.stack([alpha, mu])
        reduction = jnp.dot(b, c) + 0.5 * c @ undamped @ c

        def objective(params):
            leaves = jax.tree.leaves(params)
            wide = float_type(leaves)  # one dtype for the sum (strict promotion)
            squares = sum(jnp.sum(jnp.square(p.astype(wide))) for p in leaves)
            return quadratic.loss(params).astype(wide) + 0.5 * weight_decay * squares

        def adapt(lam):
            rho, tested = _reduction_ratio(objective, params, step, reduction)
            rho = jnp.where(tested, rho, state.rho)
            lam = jnp.where(tested & (rho > 0.75), lam * omega, lam)
            lam = jnp.where(tested & (rho < 0.25), lam / omega, lam)
            lam = jnp.clip(lam, min_damping, max_damping)
            dtype = state.damping.dtype
            return jnp.array(lam, dtype=dtype), jnp.array(rho, dtype=dtype)

        lam, rho = branch(
            (state.count + 1) % adapt_every == 0,
            adapt,
            lambda lam: (jnp.array(lam, dtype=lam.dtype), state.rho),
            state.damping,
        )
        return step, AdaptiveState(lam, step, state.count + 1, rho)

    return optax.GradientTransformationExtraArgs(init, update)


def _hole(x) -> bool:
    """A leaf that a subset of the parameters leaves out."""
    return x is None or isinstance(x, optax.MaskedNode)


def _vdots(us: list[PyTree], vs: list[PyTree]) -> Array:
    """The matrix of dot products uᵢᵀvⱼ, in float32 at least (float64 where a leaf
    is): a bfloat16 model's Gram matrix was bfloat16, and met the float32 damping
    in a sum that strict dtype promotion refuses."""
    wide = float_type([x for tree in us + vs for x in jax.tree.leaves(tree)])

    def vdot(u: PyTree, v: PyTree) -> Array:
        pairs = zip(jax.tree.leaves(u), jax.tree.leaves(v))
        return sum(
            (jnp.vdot(a.astype(wide), b.astype(wide)) for a, b in pairs),
            jnp.zeros((), wide),
        )

    return jnp.stack([jnp.stack([vdot(u, v) for v in vs]) for u in us])


def _initial_state(params: PyTree, initial_damping: float | int) -> AdaptiveState:
    """No previous update; the damping in the statistics' dtype (at least
    float32)."""
    leaves = jax.tree.leaves(params)
    dtype = leaves[0].dtype if leaves else jnp.dtype(jnp.float32)
    dtype = jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype
    return AdaptiveState(
        jnp.asarray(initial_damping, dtype),
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros((), jnp.int32),
        jnp.asarray(1.0, dtype),  # (no NaN in the state: `jax.debug_nans`)
    )


def _coefficients(gram: Array, b: Array) -> tuple[Array, Array]:
    """`(α, μ)` minimising ½ cᵀ A c + bᵀc over c = (α, μ), A = `gram` the model's
    Gram matrix of [Δ, δ₋₁]. With no previous update (δ₋₁ = 0: the first step,
    or after a zero step) or one parallel to Δ, over α alone (μ = 0); with
    Δ = 0 (a skipped direction) or non-finite terms (NaN gradients), no step."""
    a00, a01, a11 = gram[0, 0], gram[0, 1], gram[1, 1]
    alpha_only = -b[0] / jnp.where(a00 > 0, a00, 1)
    # Singular where δ₋₁ = 0 or δ₋₁ ∥ Δ (1 − cos² below the dtype's precision).
    tolerance = float(jnp.finfo(gram.dtype).eps) ** 0.5
    both = (a00 * a11 - a01**2) > tolerance * a00 * a11
    eye = jnp.eye(2, dtype=gram.dtype)
    coeffs = jnp.linalg.solve(jnp.where(both, gram, eye), -b)
    alpha = jnp.where(both, coeffs[0], jnp.where(a00 > 0, alpha_only, 0))
    mu = jnp.where(both, coeffs[1], 0)
    finite = jnp.isfinite(alpha) & jnp.isfinite(mu)
    return jnp.where(finite, alpha, 0), jnp.where(finite, mu, 0)


def _reduction_ratio(
    objective: Callable, params: PyTree, step: PyTree, reduction
) -> tuple[Array, Array]:
    """ρ, the objective's change by `step` over the quadratic model's, and whether
    the step tests the model at all: one of zero length does not (and its 0/0
    would stop a healthy run under `jax.debug_nans`)."""
    tested = reduction != 0
    new_params = jax.tree.map(lambda p, s: p + s, params, step)
    change = objective(new_params) - objective(params)
    return change / jnp.where(tested, reduction, 1), tested
