"""The squared error's family: a unit Gaussian."""

import jax
import jax.numpy as jnp

from ._family import AbstractLossFamily


class Gaussian(AbstractLossFamily):
    r"""Squared error $\frac{1}{2} \lVert y - t \rVert^2$.

    It is the negative log-likelihood of a unit Gaussian.

    !!! Example

        ```python
        family = ef.losses.Gaussian()
        y, t = jnp.array([[1.0, 2.0]]), jnp.array([[0.0, 4.0]])
        assert jnp.allclose(family.per_example(y, t), 0.5 * (1.0 + 4.0))
        assert jnp.allclose(family.output_gradient(y, t), y - t)
        assert jnp.allclose(family.sqrt_hessian(y)[0], jnp.eye(2))  # H = I
        ```
    """

    name = "gaussian"

    def per_example(self, inputs, targets):
        return 0.5 * jnp.sum(jnp.square(inputs - targets.astype(inputs.dtype)), -1)

    def sample(self, key, inputs):
        return inputs + jax.random.normal(key, inputs.shape, inputs.dtype)

    def sqrt_hessian(self, inputs):
        eye = jnp.eye(inputs.shape[-1], dtype=inputs.dtype)
        return jnp.broadcast_to(eye, inputs.shape + inputs.shape[-1:])

    def check_targets(self, inputs, targets, caller):
        if targets.shape != inputs.shape:
            raise ValueError(
                f"`{caller}(predictions, targets)`: `targets` must have the shape of "
                f"`predictions` {inputs.shape}, got {targets.shape}."
            )
