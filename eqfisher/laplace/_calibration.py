"""Calibration metrics for class probabilities."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._refusal import int_hint, refused_where


def _checked(caller: str, probs: Array, labels: Array) -> Array:
    """`probs`, after checking that they are class probabilities of shape
    `(batch, classes)` (in [0, 1], each row summing to 1) and `labels` class ids
    of shape `(batch,)` in `[0, classes)`; logits or out-of-range labels gave a
    number (or NaN) with no error."""
    probs, labels = jnp.asarray(probs), jnp.asarray(labels)
    if probs.ndim != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(
            f"`eqfisher.laplace.{caller}(probs, labels)`: `probs` must have shape "
            f"(batch, classes) and `labels` shape (batch,), got {probs.shape} and "
            f"{labels.shape}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"`eqfisher.laplace.{caller}(probs, labels)`: `labels` must be integer "
            f"class ids, got dtype {labels.dtype}."
        )
    tolerance = float(jnp.finfo(probs.dtype).eps) ** 0.5
    total = jnp.sum(probs, axis=-1)
    classes = probs.shape[-1]
    bad_probs = jnp.any(probs < 0) | jnp.any(jnp.abs(total - 1) > tolerance)
    bad_labels = jnp.any((labels < 0) | (labels >= classes))
    probs = refused_where(
        probs,
        bad_probs,
        f"`eqfisher.laplace.{caller}(probs, labels)`: `probs` must be class "
        "probabilities (non-negative, each row summing to 1); for logits pass "
        "`jax.nn.softmax(logits, axis=-1)`.",
    )
    return refused_where(
        probs,
        bad_labels,
        f"`eqfisher.laplace.{caller}(probs, labels)`: `labels` must be class ids "
        f"in [0, {classes}).",
    )


def _picked(probs, labels):
    return jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]


def negative_log_likelihood(
    probs: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> Float[Array, ""]:
    """The mean of −log p(label).

    **Arguments:**

    - `probs`: class probabilities.
    - `labels`: class ids.

    **Returns:**

    A scalar.

    !!! Example

        ```python
        probs = jnp.array([[0.5, 0.5], [0.9, 0.1]])
        labels = jnp.array([0, 0])
        print(ef.laplace.negative_log_likelihood(probs, labels))
        # (−log 0.5 − log 0.9) / 2 ≈ 0.399
        ```
    """
    probs = _checked("negative_log_likelihood", probs, labels)
    tiny = jnp.finfo(probs.dtype).tiny
    return -jnp.mean(jnp.log(jnp.maximum(_picked(probs, labels), tiny)))


def brier_score(
    probs: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> Float[Array, ""]:
    r"""The mean over examples of $\sum_k (p_k - \mathbf{1}[k = \text{label}])^2$.

    **Arguments:**

    - `probs`: class probabilities.
    - `labels`: class ids.

    **Returns:**

    A scalar.

    !!! Example

        ```python
        probs = jnp.array([[0.5, 0.5], [0.9, 0.1]])
        labels = jnp.array([0, 0])
        print(ef.laplace.brier_score(probs, labels))
        # ((0.5² + 0.5²) + (0.1² + 0.1²)) / 2 = 0.26
        ```
    """
    probs = _checked("brier_score", probs, labels)
    onehot = labels[:, None] == jnp.arange(probs.shape[-1], dtype=labels.dtype)[None, :]
    return jnp.mean(jnp.sum(jnp.square(probs - onehot.astype(probs.dtype)), axis=-1))


def expected_calibration_error(
    probs: Float[Array, "batch classes"],
    labels: Int[Array, " batch"],
    *,
    bins: int = 10,
) -> Float[Array, ""]:
    r"""The expected calibration error over equal-width confidence bins:

    $$
    \sum_{\text{bins}} (n_{\text{bin}} / n) \cdot
    \lvert \text{accuracy} - \text{confidence} \rvert.
    $$

    A confidence $c$ falls in bin $\lceil c \cdot \text{bins} \rceil - 1$ (bins are
    closed on the right, the first also on the left), as in laplace-torch's and
    torchmetrics' ECE.

    **Arguments:**

    - `probs`: class probabilities.
    - `labels`: class ids.
    - `bins`: the number of bins.

    **Returns:**

    A scalar in [0, 1].

    !!! Example

        ```python
        # Both predictions are right, at confidence 0.6 and 0.9.
        probs = jnp.array([[0.6, 0.4], [0.9, 0.1]])
        labels = jnp.array([0, 0])
        print(ef.laplace.expected_calibration_error(probs, labels))
        # (|1 − 0.6| + |1 − 0.9|) / 2 = 0.25: under-confident
        ```
    """
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
        raise ValueError(
            "`eqfisher.laplace.expected_calibration_error(..., bins=...)`: a "
            f"positive int, got {bins!r}{int_hint(bins)}."
        )
    probs = _checked("expected_calibration_error", probs, labels)
    conf = jnp.max(probs, axis=-1)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(probs.dtype)
    which = jnp.clip(jnp.ceil(conf * bins).astype(jnp.int32) - 1, 0, bins - 1)
    onehot = (which[:, None] == jnp.arange(bins, dtype=which.dtype)[None, :]).astype(
        probs.dtype
    )
    gap = jnp.abs(onehot.T @ (correct - conf))
    return jnp.sum(gap) / probs.shape[0]
