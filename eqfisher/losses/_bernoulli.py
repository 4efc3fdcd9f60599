"""The sigmoid cross-entropy's family: independent binary outputs."""

import jax
import jax.numpy as jnp

from .. import _refusal
from ._family import AbstractLossFamily


class Bernoulli(AbstractLossFamily):
    """Sigmoid cross-entropy, summed over independent binary outputs.

    !!! Example

        ```python
        family = ef.losses.Bernoulli()
        z, t = jnp.array([[0.3, -1.2]]), jnp.array([[1.0, 0.0]])  # one example
        p = jax.nn.sigmoid(z)
        by_hand = -jnp.sum(t * jnp.log(p) + (1 - t) * jnp.log(1 - p), axis=-1)
        assert jnp.allclose(family.per_example(z, t), by_hand)

        S = family.sqrt_hessian(z)[0]  # diagonal: p (1 - p)
        assert jnp.allclose(S @ S.T, jnp.diag((p * (1 - p))[0]), atol=1e-6)
        ```
    """

    name = "bernoulli"

    def per_example(self, inputs, targets):
        targets = targets.astype(inputs.dtype)
        return jnp.sum(jax.nn.softplus(inputs) - targets * inputs, axis=-1)

    def sample(self, key, inputs):
        return jax.random.bernoulli(key, jax.nn.sigmoid(inputs)).astype(inputs.dtype)

    def sqrt_hessian(self, inputs):
        p = jax.nn.sigmoid(inputs)
        sqrt_h = jnp.sqrt(p * (1 - p))
        eye = jnp.broadcast_to(
            jnp.eye(p.shape[-1], dtype=p.dtype), p.shape + p.shape[-1:]
        )
        return eye * sqrt_h[..., None, :]

    def check_targets(self, inputs, targets, caller):
        if targets.shape != inputs.shape:
            raise ValueError(
                f"`{caller}(logits, targets)`: `targets` must have the shape of "
                f"`logits` {inputs.shape}, got {targets.shape}."
            )

    def checked_targets(self, inputs, targets, mask, caller):
        if targets.dtype == jnp.bool_:
            return targets
        # Outside [0, 1] the loss is no likelihood (unbounded below in the logits).
        bad = ((targets < 0) | (targets > 1) | ~jnp.isfinite(targets)) & (
            mask[..., None] != 0
        )
        return _refusal.refused_where(
            targets,
            bad,
            f"`{caller}(logits, targets)`: `targets` must be 0/1 or probabilities "
            "in [0, 1] wherever `mask` is not 0.",
            lambda: str(targets[bad][0].item()),
        )
