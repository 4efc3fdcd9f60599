"""The registered losses users call: softmax and sigmoid cross-entropies and the
squared error."""

from jaxtyping import Array, ArrayLike, Bool, Float, Int

from ._bernoulli import Bernoulli
from ._categorical import Categorical
from ._gaussian import Gaussian
from ._register import register_loss


def softmax_cross_entropy(
    logits: Float[Array, "*leading classes"],
    labels: Int[ArrayLike, "*leading"] | Float[ArrayLike, "*leading classes"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    """Softmax cross-entropy, registered for curvature.

    **Arguments:**

    - `logits`: shape `(*leading, classes)`.
    - `labels`: integer class ids of shape `leading`, or probabilities shaped like
      `logits`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean (or mask-weighted mean) cross-entropy over every leading axis.

    **Raises:**

    - `TypeError` when the outputs are not floating-point (labels passed as
      logits) or the targets have the wrong kind of dtype.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape; the message gives the shapes expected.
    - `ValueError` (under `jit`, Equinox's runtime error) when an integer label
      lies outside `[0, classes)` where the mask is not 0, or probability labels
      are negative, not finite, or do not sum to 1 (to the square root of their
      dtype's precision) where the mask is not 0. Padding labels (e.g. -1) are
      allowed where `mask` is 0.
    - `ValueError` (under `jit`, Equinox's runtime error) when `mask` has a
      negative or non-finite entry, or sums to 0.

    !!! Example

        ```python
        def loss_fn(model, batch):
            x, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model)(x), y)  # y: class ids
        ```
    """
    return register_loss(
        Categorical(), logits, labels, mask, caller="eqfisher.softmax_cross_entropy"
    )


def sigmoid_cross_entropy(
    logits: Float[Array, "*leading out"],
    targets: Float[ArrayLike, "*leading out"]
    | Int[ArrayLike, "*leading out"]
    | Bool[ArrayLike, "*leading out"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    r"""Sigmoid (binary) cross-entropy summed over outputs, registered for curvature.

    **Arguments:**

    - `logits`: shape `(*leading, outputs)`.
    - `targets`: 0/1 (float, integer or bool), or probabilities, shaped like
      `logits`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean over every leading axis of $\sum_{\text{outputs}} \text{BCE}$.

    **Raises:**

    - `TypeError` when the logits are not floating-point, or the targets or
      `mask` are complex.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape.
    - `ValueError` (under `jit`, Equinox's runtime error) when a target lies
      outside `[0, 1]` where the mask is not 0: the loss is then no likelihood.

    !!! Example

        Three independent yes/no outputs per example:

        ```python
        targets = jax.nn.one_hot(y, 3)  # (32, 3) of 0/1

        def multilabel_loss(model, batch):
            x, t = batch
            return ef.sigmoid_cross_entropy(jax.vmap(model)(x), t)

        logits = jax.vmap(model)(x)
        by_hand = -jnp.mean(
            jnp.sum(
                targets * jax.nn.log_sigmoid(logits)
                + (1 - targets) * jax.nn.log_sigmoid(-logits),
                axis=-1,
            )
        )
        assert jnp.allclose(multilabel_loss(model, (x, targets)), by_hand)
        curv = ef.curvature(
            multilabel_loss,
            model,
            (x, targets),
            estimator=ef.GGN(),
            structure=ef.KFAC(),
        )
        ```
    """
    return register_loss(
        Bernoulli(), logits, targets, mask, caller="eqfisher.sigmoid_cross_entropy"
    )


def squared_error(
    predictions: Float[Array, "*leading out"],
    targets: Float[ArrayLike, "*leading out"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    r"""$\frac{1}{2} \lVert \text{predictions} - \text{targets} \rVert^2$ per example.

    Registered for curvature.

    **Arguments:**

    - `predictions`: shape `(*leading, outputs)`; for a scalar regression use
      `predictions[..., None]`.
    - `targets`: shaped like `predictions`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean over every leading axis of
    $\frac{1}{2} \sum_{\text{outputs}} (\text{predictions} - \text{targets})^2$ (a
    unit-variance Gaussian negative log-likelihood up to a constant).

    **Raises:**

    - `TypeError` when the outputs are not floating-point (labels passed as
      logits), or the targets or `mask` are complex.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape; the message gives the shapes expected.

    !!! Example

        ```python
        regressor = eqx.nn.MLP(4, "scalar", 8, 1, key=key)
        t = jnp.sin(x[:, 0])

        def mse_fn(model, batch):
            x, t = batch
            return ef.squared_error(jax.vmap(model)(x)[:, None], t[:, None])

        ggn = ef.ggn_operator(mse_fn, regressor, (x, t))  # here the GGN is JᵀJ / N
        ```
    """
    return register_loss(
        Gaussian(), predictions, targets, mask, caller="eqfisher.squared_error"
    )
