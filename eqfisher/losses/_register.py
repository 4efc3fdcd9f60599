"""`register_loss`: the loss value, and the tag on its inputs, after checking
what it is given."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Shaped

from .. import _precision, _refusal
from ._family import AbstractLossFamily
from ._tags import loss_tag_p, loss_value_tag_p


def register_loss(
    family: AbstractLossFamily,
    inputs: Float[Array, "*leading out"],
    targets: Shaped[ArrayLike, "..."],
    mask: Shaped[ArrayLike, "*leading"] | None = None,
    *,
    caller: str = "eqfisher.register_loss",
) -> Float[Array, ""]:
    r"""Registers a loss of the given family on `inputs` and returns its scalar value.

    **Arguments:**

    - `family`: a loss family, e.g. `eqfisher.losses.Categorical()`.
    - `inputs`: the model outputs, shape `(*leading, outputs)`.
    - `targets`: what the family expects (class ids, probabilities, values).
    - `mask`: optional per-example weights of shape `leading` (e.g. 0 for padding
      tokens); the value is then $\sum \text{mask} \cdot \ell / \sum \text{mask}$.
      Weights must be finite and non-negative with a positive sum (a
      `ValueError`, under `jit` Equinox's runtime error, otherwise).

    **Returns:**

    The scalar loss: the (mask-weighted) mean over every leading axis.

    !!! Example

        With the second half of the batch masked out (padding), value and curvature
        are those of the first half (for the exact structures; K-FAC's input factor
        averages over every example: docs/losses.md, "Masks"):

        ```python
        def masked_loss(model, batch):
            x, y, mask = batch
            logits = jax.vmap(model)(x)
            return ef.register_loss(ef.losses.Categorical(), logits, y, mask)

        padded = (x, y, jnp.arange(32) < 16)  # the mask is part of the batch
        half = (x[:16], y[:16])
        assert jnp.allclose(masked_loss(model, padded), loss_fn(model, half))

        def dense(loss, batch):
            return ef.curvature(
                loss, model, batch, estimator=ef.GGN(), structure=ef.Dense()
            ).as_matrix()

        assert jnp.allclose(dense(masked_loss, padded), dense(loss_fn, half), atol=1e-6)
        ```
    """
    if not isinstance(family, AbstractLossFamily):
        raise TypeError(
            f"`{caller}(family, ...)`: `family` must be a loss family such as "
            f"`eqfisher.losses.Categorical()`, got {family!r}."
        )
    inputs = _one_array(inputs, "the outputs (its first argument)", caller)
    targets = _one_array(targets, "the targets (its second argument)", caller)
    mask = None if mask is None else _one_array(mask, "`mask`", caller)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
        raise TypeError(
            f"`{caller}`: the loss must be registered on a floating-point array "
            f"(the model outputs), got dtype {inputs.dtype}; pass the logits or "
            "predictions, not labels."
        )
    _check_shape(inputs, caller)
    for name, array in (("targets", targets), ("mask", mask)):
        if array is not None and jnp.issubdtype(
            jnp.result_type(array), jnp.complexfloating
        ):
            raise TypeError(
                f"`{caller}`: `{name}` must be real, got dtype "
                f"{jnp.result_type(array)} (its imaginary part would be dropped)."
            )
    family.check_targets(inputs, targets, caller)
    leading = inputs.shape[:-1]
    if mask is None:
        mask = jnp.ones(leading, inputs.dtype)
    else:
        if mask.shape != leading:
            raise ValueError(
                f"`{caller}(..., mask=...)`: `mask` must have shape {leading} "
                f"(the leading axes of the outputs), got {mask.shape}."
            )
        mask = mask.astype(inputs.dtype)
        mask = _refusal.refused_where(
            mask,
            (mask < 0) | ~jnp.isfinite(mask) | (jnp.sum(mask) <= 0),
            f"`{caller}(..., mask=...)`: `mask` must be finite and >= 0 with a "
            "positive sum (the value is sum(mask * loss) / sum(mask)); a negative "
            "weight makes the curvature indefinite. Give padding weight 0. (The "
            "functions of `eqfisher.influence` call `loss_fn` on one example at a "
            "time, where a padded example alone has a mask of sum 0: leave padded "
            "examples out of the batches given to them. Under "
            "`eqfisher.optim.kfac_step(..., curvature_batch_size=n)` the "
            "statistics' loss is that of the first n examples: their mask needs a "
            "positive sum too. `eqfisher.dataset_curvature` takes each batch's "
            "loss: leave out a batch that is all padding.)",
        )
    targets = family.checked_targets(inputs, targets, mask, caller)
    mask = family.checked_mask(inputs, targets, mask, caller)
    tagged = loss_tag_p.bind(inputs, targets, mask, family=family)
    # Both sums in float32 at least: a float16 count above 65,504 is inf.
    wide = _precision.at_least_float32(inputs.dtype)
    per_example = _per_example(family, tagged, targets, leading, caller)
    total = jnp.sum(mask * per_example, dtype=wide)
    value = (total / jnp.sum(mask, dtype=wide)).astype(inputs.dtype)
    return loss_value_tag_p.bind(value)


def _check_shape(inputs: Array, caller: str) -> None:
    """Refuses outputs that are not a batch of examples' outputs, or hold none: the
    value is a mean over examples (0/0 over none), and a family's loss a function
    of at least one output."""
    if inputs.ndim < 2:
        raise ValueError(
            f"`{caller}`: outputs need shape (*examples, outputs), got "
            f"{inputs.shape}: a loss is registered on a batch of examples. For one "
            "output per example (a batch of scalars), use `outputs[..., None]`; for "
            "one example's outputs (a loss written per example, under `jax.vmap`), "
            "register the batch's outputs instead (`jax.vmap(model)(x)`), or "
            "`outputs[None]` and `targets[None]`."
        )
    if 0 in inputs.shape[:-1]:
        raise ValueError(
            f"`{caller}`: the outputs are shaped {inputs.shape}: the batch holds no "
            "examples, and the loss is their mean (0/0, NaN). Pass a batch of at "
            "least one example."
        )
    if inputs.shape[-1] == 0:
        raise ValueError(
            f"`{caller}`: the outputs are shaped {inputs.shape}: each example has "
            "no outputs (a model of 0 outputs, or 0 classes). A loss needs at least "
            "one."
        )


def _one_array(value: Any, name: str, caller: str) -> Array:
    """`value` as one array. A tuple, list or dict holding arrays (the outputs of a
    model that returns several) is refused: `jnp.asarray` stacked one of equal
    shapes into another batch axis, and failed on others in JAX's words."""
    several = isinstance(value, dict) or (
        isinstance(value, tuple | list)
        and any(hasattr(v, "shape") for v in jax.tree_util.tree_leaves(value))
    )
    if several:
        hint = (
            "A model that returns several outputs returns them together: pass the "
            "one the loss is on, e.g. `out[0]` or `out['logits']`."
            if name.startswith("the outputs")
            else "Pass the array itself, e.g. `batch['labels']`."
        )
        raise TypeError(
            f"`{caller}`: {name} must be one array, got a {type(value).__name__} "
            f"(of length {len(value)}). {hint}"
        )
    return jnp.asarray(value)


def _per_example(family, inputs, targets, leading: tuple, caller: str) -> Array:
    """`family.per_example(inputs, targets)`, refused unless one real loss per
    example: a scalar (the sum over examples) gave a value and gradient N times
    the mean's beside the mean's curvature, integers a zero gradient."""
    per_example = family.per_example(inputs, targets)
    if jnp.shape(per_example) != leading or not jnp.issubdtype(
        jnp.result_type(per_example), jnp.floating
    ):
        raise ValueError(
            f"`{caller}`: `{type(family).__name__}.per_example(inputs, targets)` "
            f"must return one real loss per example, shaped {leading} (the leading "
            f"axes of the inputs, the output axis summed), got "
            f"{jnp.result_type(per_example)} of shape {jnp.shape(per_example)}."
        )
    return per_example
