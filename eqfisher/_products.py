"""Exact, matrix-free curvature products as lineax operators, and `stop_hessian`."""

import abc
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import lineax as lx
import optax
from jaxtyping import Array, Float, PyTree

from . import _compat
from ._curvature import leaf_shapes
from ._stop_hessian import stop_hessian as stop_hessian
from ._tracer import (
    RegisteredLoss,
    StagedLoss,
    calls_custom_vjp,
    refuse_complex,
    split,
)
from .blocks._base import register_unstructured


def _structure(params: PyTree) -> PyTree:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )


class MatrixFreeOperator(lx.AbstractLinearOperator):
    r"""An exact curvature of `loss_fn` as a matrix-free lineax operator: what
    `ggn_operator`, `empirical_fisher_operator` and `hessian_operator` return.

    An `eqx.Module` whose fields are the model's and the batch's arrays (their
    other leaves, and `loss_fn`, are static), like `lineax.JacobianLinearOperator`:
    pass it into `eqx.filter_jit` or `jax.jit`, carry it through `lax.scan`, or
    `jax.vmap` over a stack of them, and a new model or batch of the same shapes
    compiles nothing new. `mv` linearises the model and applies the product;
    `lineax.linearise(operator)` linearises once (one forward pass), giving a
    `lineax.FunctionLinearOperator` whose every `mv` is one JVP and one VJP (the
    GGN, the empirical Fisher) or one forward-over-reverse product (the Hessian).
    lineax's solvers and `eqfisher.spectral` linearise it once themselves.

    The operand is a PyTree like `eqx.filter(model, eqx.is_inexact_array)`.

    !!! Example

        ```python
        @eqx.filter_jit
        def newton_direction(ggn, g):  # compiled once, for every batch
            damped = lx.TaggedLinearOperator(
                ggn + 1e-3 * lx.IdentityLinearOperator(ggn.in_structure()),
                lx.positive_semidefinite_tag,
            )
            return lx.linear_solve(damped, g, lx.CG(rtol=1e-6, atol=1e-6)).value

        step = newton_direction(ef.ggn_operator(loss_fn, model, batch), grads)
        ```
    """

    # The function that builds it, named in its messages.
    caller: ClassVar[str] = "eqfisher.MatrixFreeOperator"
    params: PyTree
    model_arrays: PyTree
    batch_arrays: PyTree
    model_static: PyTree = eqx.field(static=True)
    batch_static: PyTree = eqx.field(static=True)
    loss_fn: Callable = eqx.field(static=True)

    def __init__(self, loss_fn: Callable, model: PyTree, batch: PyTree):
        """**Arguments:** `loss_fn(model, batch) -> scalar`, the model and the batch,
        as for `eqfisher.ggn_operator` (which builds the GGN's). Checks that
        `loss_fn` is one this matrix is defined for (traces it, computes
        nothing)."""
        if _compat.in_manual_mesh():
            raise ValueError(
                f"`{self.caller}`: called inside `jax.shard_map`: the matrix-free "
                "operators do not run there "
                "(their products mix the batch's device-varying values with "
                "replicated vectors). Shard the batch with `jax.device_put` and "
                "call the operator under `jax.jit`, which inserts the reductions "
                "(docs/scale.md)."
            )
        refuse_complex(self.caller, model)
        self.check(loss_fn, model, batch)
        params, rest = eqx.partition(model, eqx.is_inexact_array)
        self.params = params
        self.model_arrays, self.model_static = eqx.partition(rest, eqx.is_array)
        self.batch_arrays, self.batch_static = eqx.partition(batch, eqx.is_array)
        self.loss_fn = loss_fn

    @abc.abstractmethod
    def tags(self) -> frozenset:
        """lineax's tags of the matrix."""

    @abc.abstractmethod
    def product_at(
        self, loss_fn: Callable, model: PyTree, batch: PyTree
    ) -> Callable[[PyTree], PyTree]:
        """The product `v -> M v` at `model` and `batch`, the model linearised
        once."""

    def check(self, loss_fn: Callable, model: PyTree, batch: PyTree) -> None:
        """Refuses a `loss_fn` this matrix is not defined for, when the operator is
        built. (None to check by default.)"""

    def product(self) -> Callable[[PyTree], PyTree]:
        """`v -> M v`, the model linearised once."""
        model = eqx.combine(self.params, self.model_arrays, self.model_static)
        batch = eqx.combine(self.batch_arrays, self.batch_static)
        return self.product_at(self.loss_fn, model, batch)

    def linearised(self) -> lx.FunctionLinearOperator:
        """The product with the model linearised once: `lineax.linearise(self)`."""
        return lx.FunctionLinearOperator(
            self.product(), _structure(self.params), tags=self.tags()
        )

    def mv(self, vector: PyTree) -> PyTree:
        """The product, the model linearised for it (see `lineax.linearise`)."""
        want = self.in_structure()
        shapes = [s.shape for s in jax.tree_util.tree_leaves(want)]
        got = leaf_shapes(jax.tree_util.tree_leaves(vector))
        same = jax.tree_util.tree_structure(vector) == jax.tree_util.tree_structure(
            want
        )
        if not same or got != shapes:
            raise ValueError(
                "`MatrixFreeOperator.mv(vector)`: `vector` must have the structure "
                "of the model's parameters, `eqx.filter(model, eqx.is_inexact_array)` "
                "(a gradient from `eqx.filter_grad` has it; for a flat vector, "
                "`jax.flatten_util.ravel_pytree` of that gives the function that "
                f"unflattens it). Expected leaves shaped {shapes}, got {got}"
                f"{'' if same else ' in another structure'}."
            )
        return _product(self, vector)

    def as_matrix(self) -> Float[Array, "size size"]:
        """The dense matrix, rows and columns in `ravel_pytree` order."""
        return _dense(self)

    def transpose(self) -> "MatrixFreeOperator":
        """Itself: the matrix is symmetric."""
        return self

    def in_structure(self) -> PyTree:
        """The operand: `jax.ShapeDtypeStruct`s like the model's parameters."""
        return _structure(self.params)

    def out_structure(self) -> PyTree:
        """The same as `in_structure`."""
        return _structure(self.params)


class _OutputProduct(MatrixFreeOperator):
    """Jᵀ M J for a matrix M of the registered losses' inputs (`weigh`: t ↦ M t)."""

    @abc.abstractmethod
    def weigh(self, loss: RegisteredLoss, tangent: Array) -> Array:
        """M t for one registered loss and a tangent of its inputs."""

    def tags(self) -> frozenset:
        return frozenset({lx.symmetric_tag, lx.positive_semidefinite_tag})

    def check(self, loss_fn, model, batch) -> None:
        _staged(self.caller, loss_fn, model, batch)

    def product_at(self, loss_fn, model, batch) -> Callable[[PyTree], PyTree]:
        s = split(model, batch)
        processed = StagedLoss(loss_fn, self.caller).stage(s, layers=False)
        coefs = processed.coefficients(s.inputs)
        params = eqx.filter(model, eqx.is_inexact_array)

        def fn(params):
            leaves = jax.tree_util.tree_leaves(params)
            ev = processed.run(leaves + s.others + s.batch)
            return tuple(t[0] for t in ev.tags), processed.losses(ev, coefs)

        if processed.calls_custom_vjp:
            # A `jax.custom_vjp` has no forward-mode rule: J v is the transpose of
            # the (linear) VJP, as `jax.jacrev` works where `jax.jacfwd` cannot.
            outs, vjp_fn, losses = jax.vjp(fn, params, has_aux=True)
            transposed = jax.linear_transpose(vjp_fn, outs)

            def jvp_fn(v):
                return transposed((v,))[0]
        else:
            _, jvp_fn, losses = jax.linearize(fn, params, has_aux=True)
            vjp_fn = jax.linear_transpose(jvp_fn, params)

        def mv(v):
            jv = jvp_fn(v)
            return vjp_fn(tuple(self.weigh(loss, t) for loss, t in zip(losses, jv)))[0]

        return mv


class _GGN(_OutputProduct):
    caller = "eqfisher.ggn_operator"

    def weigh(self, loss, tangent):
        w = loss.weights()[..., None]
        return w * loss.family.hessian_mv(loss.inputs, tangent)


class _EmpiricalFisher(_OutputProduct):
    caller = "eqfisher.empirical_fisher_operator"

    def weigh(self, loss, tangent):
        # Example n's gradient pulls back its entries' √w-weighted output
        # gradients, uₙ = Σₜ √wₙₜ Jₙₜᵀ rₙₜ; Σₙ uₙ (uₙᵀ v) pulls back
        # √wₙₜ rₙₜ (uₙᵀ v), with uₙᵀ v = Σₜ √wₙₜ rₙₜ · (J v)ₙₜ.
        r = loss.family.output_gradient(loss.inputs, loss.targets)
        r = r * jnp.sqrt(loss.weights())[..., None]
        along = jnp.sum((r * tangent).reshape(r.shape[0], -1), axis=1)
        return r * along.reshape((-1,) + (1,) * (r.ndim - 1))


class _Hessian(MatrixFreeOperator):
    caller = "eqfisher.hessian_operator"

    def tags(self) -> frozenset:
        return frozenset({lx.symmetric_tag})

    def product_at(self, loss_fn, model, batch) -> Callable[[PyTree], PyTree]:
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def grad(p):
            return jax.grad(lambda q: loss_fn(eqx.combine(q, static), batch))(p)

        def reverse_over_reverse(v):
            return jax.grad(lambda q: optax.tree_utils.tree_vdot(grad(q), v))(params)

        def forward_over_reverse(v):
            return jax.jvp(grad, (params,), (v,))[1]

        if not calls_custom_vjp(
            lambda p: loss_fn(eqx.combine(p, static), batch), params
        ):
            return jax.linearize(grad, params)[1]
        # JAX has no forward mode through most custom rules' gradients ("can't
        # apply forward-mode autodiff (jvp) to a custom_vjp function", when the
        # product runs): reverse over reverse (the custom rule differentiated),
        # as `jax.jacrev` of `jax.jacrev` works where `jax.hessian` cannot.
        try:
            jax.eval_shape(reverse_over_reverse, params)
        except ValueError as error:
            # A custom rule whose own reverse mode fails (Equinox's checkpointed
            # `while_loop`: "Reverse-mode differentiation does not work for
            # lax.while_loop") may have a JVP: one of the gradient per product
            # (`jax.linearize` would split the loop, which it refuses too).
            try:
                jax.eval_shape(forward_over_reverse, params)
            except Exception:
                raise error from None
            return forward_over_reverse
        return reverse_over_reverse


# Compiled (to nothing), so that an operator built again for a new batch of the
# same shapes does not trace `loss_fn` again to check it: jit's cache keeps the
# trace, as `eqfisher.curvature`'s does.
@eqx.filter_jit
def _staged(caller: str, loss_fn: Callable, model: PyTree, batch: PyTree) -> None:
    StagedLoss(loss_fn, caller).stage(split(model, batch), layers=False)


# Compiled, so that an operator used eagerly traces `loss_fn` once per shapes and
# `loss_fn`, not at every call (and runs one program, not one per operation);
# inside a caller's `jit` they are inlined. The raw product, not a
# `lx.FunctionLinearOperator` of it: that one's shape check enters Equinox's
# cache, which then holds this trace's tracers (`jax.checking_leaks()` failed).
@eqx.filter_jit
def _product(operator: MatrixFreeOperator, vector: PyTree) -> PyTree:
    return operator.product()(vector)


@eqx.filter_jit
def _dense(operator: MatrixFreeOperator) -> Array:
    """The matrix, one product per unit vector (its columns)."""
    flat, unravel = jax.flatten_util.ravel_pytree(operator.params)
    product = operator.product()
    rows = jax.vmap(lambda e: jax.flatten_util.ravel_pytree(product(unravel(e)))[0])
    return rows(jnp.eye(flat.size, dtype=flat.dtype)).T


def _register(cls: type) -> None:
    """lineax's queries and transformations of a `MatrixFreeOperator`: its tags,
    and the rest through its linearised product."""
    lx.linearise.register(cls)(lambda op: op.linearised())
    lx.materialise.register(cls)(lambda op: lx.materialise(op.linearised()))
    lx.diagonal.register(cls)(lambda op: lx.diagonal(op.linearised()))
    lx.tridiagonal.register(cls)(lambda op: lx.tridiagonal(op.linearised()))
    lx.conj.register(cls)(lambda op: op)  # real
    tagged = {
        lx.is_symmetric: lx.symmetric_tag,
        lx.is_positive_semidefinite: lx.positive_semidefinite_tag,
    }
    for query, tag in tagged.items():
        query.register(cls)(lambda op, tag=tag: tag in op.tags())
    register_unstructured(cls)


_register(MatrixFreeOperator)


def linearised(operator: lx.AbstractLinearOperator) -> lx.AbstractLinearOperator:
    """`lineax.linearise(operator)`, for many products with one operator: a
    `MatrixFreeOperator`'s model (and a `lineax.JacobianLinearOperator`'s) is then
    linearised once, not at every product. An operator type lineax cannot
    linearise is returned as it is."""
    try:
        return lx.linearise(operator)
    except NotImplementedError:
        return operator


def ggn_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> MatrixFreeOperator:
    r"""The exact GGN $\sum_n w_n J_n^\top H_n J_n$ as a matrix-free lineax operator.

    One Jacobian-vector product, the loss Hessians, and one vector-Jacobian product
    per `mv`; symmetric and positive-semidefinite, so `lineax.CG` works on it (add
    damping first). The operand is a PyTree like `eqx.filter(model,
    eqx.is_inexact_array)`.

    **Raises:**

    `ValueError` when `loss_fn` registers no loss, or its value is not affine in
    the registered losses (the message names the fix).

    !!! Example

        ```python
        ggn = ef.ggn_operator(loss_fn, model, batch)
        damped = lx.TaggedLinearOperator(
            ggn + lx.IdentityLinearOperator(ggn.in_structure()) * 1e-3,
            lx.positive_semidefinite_tag,
        )
        solution = lx.linear_solve(damped, grads, lx.CG(rtol=1e-6, atol=1e-6))
        step = solution.value  # (G + 0.001 I)⁻¹ g, like grads
        ```
    """

    # `MatrixFreeOperator.__init__`, inherited (pyright synthesises a dataclass one).
    return _GGN(loss_fn, model, batch)  # pyright: ignore[reportCallIssue]


def empirical_fisher_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> MatrixFreeOperator:
    r"""The exact empirical Fisher, matrix-free.

    $\sum_n w_n \nabla \ell_n \nabla \ell_n^\top$, the outer products of the
    per-example loss gradients at the batch's targets; a symmetric,
    positive-semidefinite lineax operator on PyTrees like `eqx.filter(model,
    eqx.is_inexact_array)`.

    As for `eqfisher.EmpiricalFisher`, $\ell_n$ is example $n$'s loss: its entries
    along the other axes of a registered loss (a sequence's $T$ positions) are
    summed before the outer product, and several registered losses add their
    matrices. The example axis is each registered loss's first, whatever the
    batch's is: for outputs laid out otherwise (time-major, or stacked over an
    ensemble's members), this is another matrix than `eqfisher.curvature(...,
    estimator=eqfisher.EmpiricalFisher())`, which finds the example axis (or takes
    `examples=`); use that.

    **Raises:**

    `ValueError` when `loss_fn` registers no loss, or its value is not affine in
    the registered losses (the message names the fix).

    !!! Example

        ```python
        fisher = ef.empirical_fisher_operator(loss_fn, model, batch)
        print(optax.tree_utils.tree_vdot(grads, fisher.mv(grads)))  # gᵀ F g ≥ 0
        ```
    """

    # `MatrixFreeOperator.__init__`, inherited (pyright synthesises a dataclass one).
    return _EmpiricalFisher(loss_fn, model, batch)  # pyright: ignore[reportCallIssue]


def hessian_operator(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]], model: PyTree, batch: PyTree
) -> MatrixFreeOperator:
    """The exact Hessian of `loss_fn` in the parameters, matrix-free (symmetric, not
    necessarily positive-semidefinite), by forward-over-reverse differentiation.

    `loss_fn` needs no registered loss here: it is differentiated as it is. The
    product is forward-over-reverse, or reverse-over-reverse for a `loss_fn`
    that calls a `jax.custom_vjp` function (which has no forward-mode rule).

    **Raises:**

    Nothing of its own: the errors of `loss_fn` and `jax.grad` on it.

    !!! Example

        ```python
        hessian = ef.hessian_operator(loss_fn, model, batch)
        low, high = ef.spectral.extreme_eigenvalues(hessian, iterations=30, key=key)
        ```
    """
    # `MatrixFreeOperator.__init__`, inherited (pyright synthesises a dataclass one).
    return _Hessian(loss_fn, model, batch)  # pyright: ignore[reportCallIssue]
