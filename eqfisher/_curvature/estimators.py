"""Curvature estimators: which matrix is estimated, as a final Module each.

Every estimator turns one registered loss into *output vectors* V of shape
`(k, *leading, out)`, scaled so that the estimated curvature is

    C = Σₙ Σₖ Jₙᵀ V[k, n] V[k, n]ᵀ Jₙ,

with Jₙ the Jacobian of example n's loss inputs w.r.t. the parameters. The weights
wₙ of the loss value (1/N for a mean) are folded into V as √wₙ.
"""

import abc
import math
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._refusal import int_hint
from .._tracer import RegisteredLoss


# To pyright, `AbstractClassVar` is `typing.ClassVar`, as equinox makes it; the alias
# is made here because pyright reads one only in the module that makes it (and would
# otherwise take the class variables below for arguments of `__init__`).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractEstimator(eqx.Module):
    """Which curvature matrix to estimate.

    An estimator sets two class variables:

    - `needs_key`: whether `output_vectors` needs a `key` (it samples).
    - `splits_positions`: whether `example_vectors` splits an example's vectors by
      position, one vector per position, as a square root of a loss Hessian that is
      block-diagonal over positions needs. `False` declares that `example_vectors`
      returns `vectors` unchanged: an example's vectors are then its slice of the
      batch's, and eqfisher takes some per-example vectors (scale-and-shift layers)
      from the batch's pullback instead of a pass per example. `True` declares
      that it returns them unchanged for losses without positions, `(k, n, out)`.

    and implements three methods:

    - `output_vectors(loss, key)`: the scaled vectors V, `(k, *leading, out)`, whose
      outer products give the curvature in the loss's inputs (see the module).
    - `example_vectors(vectors)`: from V with the example axis first after k,
      `(k, n, *positions, out)`, the vectors whose pullbacks through one example's
      Jacobian give that example's exact curvature.
    - `batch_vectors(vectors, axis)`: the vectors whose pullbacks through the whole
      batch give the exact curvature when examples interact (`axis`: the example
      axis among the leading axes).

    !!! Example

        The empirical Fisher, written as a subclass (one vector per example: its
        weighted gradient in the loss's inputs), against per-example gradients:

        ```python
        from jax.flatten_util import ravel_pytree

        class MyEmpiricalFisher(ef.AbstractEstimator):
            needs_key = False
            splits_positions = False  # `example_vectors` returns its input

            def output_vectors(self, loss, key):
                g = loss.family.output_gradient(loss.inputs, loss.targets)
                return (g * jnp.sqrt(loss.weights())[..., None])[None]  # (1, 32, 3)

            def example_vectors(self, vectors):
                return vectors  # an example's vector is already its own

            def batch_vectors(self, vectors, axis):
                return ef.EmpiricalFisher().batch_vectors(vectors, axis)

        curv = ef.curvature(
            loss_fn, model, batch, estimator=MyEmpiricalFisher(), structure=ef.Dense()
        )

        def example_grad(x, y):  # loss_fn on a batch of one example
            g = eqx.filter_grad(loss_fn)(model, (x[None], y[None]))
            return ravel_pytree(g)[0]

        per_example = jax.vmap(example_grad)(x, y)  # (32, 67)
        expected = per_example.T @ per_example / 32
        assert jnp.allclose(curv.as_matrix(), expected, atol=1e-6)
        ```
    """

    needs_key: AbstractClassVar[bool]
    splits_positions: AbstractClassVar[bool]

    @abc.abstractmethod
    def output_vectors(
        self, loss: RegisteredLoss, key: PRNGKeyArray | None
    ) -> Float[Array, "k *leading out"]:
        """The scaled vectors V whose outer products give the loss-output curvature."""

    @abc.abstractmethod
    def example_vectors(
        self, vectors: Float[Array, "k n *positions out"]
    ) -> Float[Array, "kk n *positions out"]:
        """The vectors whose per-example pullbacks give the exact curvature."""

    @abc.abstractmethod
    def batch_vectors(
        self, vectors: Float[Array, "k *leading out"], axis: int
    ) -> Float[Array, "kk *leading out"]:
        """The vectors whose full-batch pullbacks give the exact curvature."""


def split_along(v: Array, axes: tuple[int, ...]) -> Array:
    """`(k, *leading, out)` vectors → `(P·k, *leading, out)`, P the number of index
    combinations along the given leading `axes`, each new vector nonzero at one
    combination only."""
    axes = tuple(1 + a for a in axes)
    rest = [a for a in range(1, v.ndim) if a not in axes]
    moved = jnp.transpose(v, (0,) + axes + tuple(rest))
    k = v.shape[0]
    p = math.prod(v.shape[a] for a in axes)
    flat = moved.reshape((k, p, -1))
    out = jnp.einsum("kqr,pq->pkqr", flat, jnp.eye(p, dtype=v.dtype))
    out = out.reshape((p * k,) + moved.shape[1:])
    perm = (0,) + axes + tuple(rest)
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(perm)))


def split_positions(vectors: Array) -> Array:
    """`example_vectors` for a square root of a loss Hessian that is block-diagonal
    over positions: one vector per position (see `_per_position`)."""
    return vectors if vectors.ndim <= 3 else _per_position(vectors)


def split_everywhere(vectors: Array) -> Array:
    """`batch_vectors` for a square root of a loss Hessian that is block-diagonal
    over positions: one vector per leading index (example and position)."""
    return split_along(vectors, tuple(range(vectors.ndim - 2)))


def _sqrt_weights(loss: RegisteredLoss) -> Array:
    return jnp.sqrt(loss.weights())[..., None]


class GGN(AbstractEstimator):
    r"""The generalised Gauss-Newton matrix $\frac{1}{N} \sum_n J_n^\top H_n J_n$.

    $H_n$ is the loss Hessian. Uses a square-root factor of each $H_n$ (one output
    vector per output coordinate), batched over coordinates.

    !!! Example

        ```python
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense())
        print(jnp.linalg.eigvalsh(curv.as_matrix()).min())  # ≥ 0 up to rounding: PSD
        ```
    """

    needs_key = False
    splits_positions = True

    def output_vectors(self, loss, key):
        s = loss.family.sqrt_hessian(loss.inputs)  # (*leading, out, k)
        return jnp.moveaxis(s * _sqrt_weights(loss)[..., None], -1, 0)

    def example_vectors(self, vectors):
        return split_positions(vectors)

    def batch_vectors(self, vectors, axis):
        return split_everywhere(vectors)


class FisherExact(AbstractEstimator):
    """The Fisher information under the model's predictive distribution, exactly.

    For the registered losses (negative log-likelihoods of exponential families in
    their natural parameters) it equals the GGN.

    !!! Example

        ```python
        def dense(estimator):
            return ef.curvature(
                loss_fn, model, batch, estimator=estimator, structure=ef.Dense()
            ).as_matrix()

        print(jnp.abs(dense(ef.FisherExact()) - dense(ef.GGN())).max())  # ≈ 0
        ```
    """

    needs_key = False
    splits_positions = True

    def output_vectors(self, loss, key):
        return GGN().output_vectors(loss, key)

    def example_vectors(self, vectors):
        return split_positions(vectors)

    def batch_vectors(self, vectors, axis):
        return split_everywhere(vectors)


class FisherMC(AbstractEstimator):
    """The Fisher estimated with `samples` targets drawn from the model per example.

    **Arguments:**

    - `samples`: how many targets to draw per example (at least 1).

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.FisherMC(samples=4), structure=ef.KFAC(),
            key=jax.random.key(1),  # needed: targets are sampled
        )
        ```
    """

    samples: int = eqx.field(static=True, default=1)
    needs_key = True
    splits_positions = False

    def __check_init__(self):
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(
                f"`eqfisher.FisherMC(samples=...)`: `samples` must be a positive int, "
                f"got {self.samples!r}{int_hint(self.samples)}."
            )

    def output_vectors(self, loss, key):
        assert key is not None  # `needs_key`: the builder has checked
        inputs = jax.lax.stop_gradient(loss.inputs)

        def one(k):
            targets = _sampled(loss.family, k, inputs)
            return loss.family.output_gradient(inputs, targets)

        if self.samples == 1:
            grads = one(key)[None]
        else:
            grads = jax.vmap(one)(jax.random.split(key, self.samples))
        scale = jnp.sqrt(jnp.asarray(1.0 / self.samples, inputs.dtype))
        return grads * _sqrt_weights(loss)[None] * scale

    def example_vectors(self, vectors):
        # Cross-position terms vanish in expectation: no split.
        return vectors

    def batch_vectors(self, vectors, axis):
        return split_along(vectors, (axis,))


def _sampled(family, key, inputs):
    """`family.sample`, checked as `family` checks a batch's targets: targets that
    broadcast against `inputs` would otherwise give other gradients silently."""
    targets = family.sample(key, inputs)
    name = f"{type(family).__name__}.sample"
    try:
        family.check_targets(inputs, targets, name)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"`eqfisher.FisherMC`: `{name}` drew targets of shape {targets.shape} "
            f"and dtype {targets.dtype} for inputs of shape {inputs.shape}, which "
            f"the family's own `check_targets` refuses: {error} `sample` must "
            "return targets of the kind `check_targets` accepts."
        ) from None
    return targets


class EmpiricalFisher(AbstractEstimator):
    r"""$\sum_n w_n \nabla \ell_n \nabla \ell_n^\top$: outer products of gradients.

    The per-example gradients are taken at the data targets. Not the Fisher: it uses
    the data's labels, not targets drawn from the model.

    With the objective written as $\sum_n w_n \ell_n$, $\ell_n$ is example $n$'s
    whole loss: for a loss with positions (a sequence's $T$ tokens) averaged over
    all $N T$ entries, $\ell_n$ sums its $T$ entries and $w_n = 1/(N T)$, so the
    matrix is $T$ times $\frac{1}{N} \sum_n \nabla L_n \nabla L_n^\top$ for the
    per-example mean losses $L_n = \ell_n / T$.

    !!! Example

        ```python
        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.EmpiricalFisher(), structure=ef.Diagonal()
        )
        ```
    """

    needs_key = False
    splits_positions = False

    def output_vectors(self, loss, key):
        grads = loss.family.output_gradient(loss.inputs, loss.targets)
        return (grads * _sqrt_weights(loss))[None]

    def example_vectors(self, vectors):
        # An example's gradient sums over its positions: no split.
        return vectors

    def batch_vectors(self, vectors, axis):
        return split_along(vectors, (axis,))


def _per_position(v: Array) -> Array:
    """`(k, n, *positions, out)` vectors → `(P·k, n, *positions, out)`, P the number
    of positions, each new vector nonzero at one position only.

    An example with several positions (tokens, pixels) has a block-diagonal loss
    Hessian, one block per position. Vector k of the estimator holds the k-th
    column of every block at once, which is right for K-FAC (whose G sums over
    locations) but, pulled back through one example's Jacobian, mixes positions:
    Σₖ (Σₜ Jₜᵀvₖₜ)(Σₜ' Jₜ'ᵀvₖₜ')ᵀ has cross terms t ≠ t'. Splitting the vectors by
    position removes them.
    """
    k, n, out = v.shape[0], v.shape[1], v.shape[-1]
    positions = v.shape[2:-1]
    p = math.prod(positions)
    flat = v.reshape(k, n, p, out)
    split = jnp.einsum("knqc,pq->pknqc", flat, jnp.eye(p, dtype=v.dtype))
    return split.reshape((p * k, n) + positions + (out,))


def loss_vectors(
    estimator: AbstractEstimator,
    losses: tuple[RegisteredLoss, ...],
    key: PRNGKeyArray | None,
) -> list[Array]:
    """Each registered loss's output vectors `(k, *inputs.shape)`."""
    if key is None or len(losses) == 1:
        keys = [key] * len(losses)
    else:
        keys = list(jax.random.split(key, len(losses)))
    return [
        jax.lax.stop_gradient(_checked(estimator, loss, _vectors(estimator, loss, k)))
        for loss, k in zip(losses, keys)
    ]


def _vectors(estimator: AbstractEstimator, loss: RegisteredLoss, key) -> Array:
    """`estimator.output_vectors(loss, key)`; a use of the absent key by an
    estimator that does not declare `needs_key` failed in JAX's words."""
    try:
        return estimator.output_vectors(loss, key)
    except (TypeError, ValueError) as error:
        if key is not None or estimator.needs_key or "key" not in str(error).lower():
            raise
        name = type(estimator).__name__
        raise type(error)(
            f"`{name}.output_vectors(loss, key)` failed with `key=None` ({error}). "
            f"The call gave no `key=` because `{name}.needs_key` is False: an "
            "estimator that samples sets `needs_key = True`, and eqfisher then "
            "asks its callers for `key=`."
        ) from error


def _checked(estimator: AbstractEstimator, loss: RegisteredLoss, v) -> Array:
    """`v`, the vectors of `estimator` for `loss`, checked to be an array of the
    loss inputs' dtype shaped `(k, *loss.inputs.shape)`: others failed deep inside
    the pull-back, with JAX's messages."""
    want = tuple(loss.inputs.shape)
    dtype = loss.inputs.dtype
    ok = (
        isinstance(v, jax.Array)
        and v.ndim == len(want) + 1
        and tuple(v.shape[1:]) == want
        and v.dtype == dtype
    )
    if not ok:
        got = (
            f"{v.dtype}{list(v.shape)}"
            if isinstance(v, jax.Array)
            else type(v).__name__
        )
        family = type(loss.family).__name__
        raise ValueError(
            f"`{type(estimator).__name__}.output_vectors` must return the vectors V "
            f"of one registered loss as an array `(k, *inputs.shape)` of the "
            f"inputs' dtype, here {dtype}[k, {', '.join(map(str, want))}]; got "
            f"{got} (for the loss family {family}, whose `sqrt_hessian`, "
            "`sample` and `output_gradient` the built-in estimators read)."
        )
    return v


def stacked_vectors(per_loss: list[Array]) -> tuple[Array, ...]:
    """One `(K, *inputs.shape)` cotangent per loss, K = Σ over losses of their k.

    Column blocks belong to one loss each and are zero for the others, so a single
    batched VJP over K pulls back every loss's vectors at once.
    """
    if len(per_loss) == 1:
        return tuple(per_loss)
    total = sum(v.shape[0] for v in per_loss)
    out, start = [], 0
    for v in per_loss:
        padded = jnp.zeros((total,) + v.shape[1:], v.dtype)
        out.append(padded.at[start : start + v.shape[0]].set(v))
        start += v.shape[0]
    return tuple(out)
