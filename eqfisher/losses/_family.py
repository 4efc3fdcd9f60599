"""`AbstractLossFamily`: the distribution a registered loss is the negative
log-likelihood of, and what the estimators read from it."""

import abc
from typing import TYPE_CHECKING, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, Shaped


# To pyright, `AbstractClassVar` is `typing.ClassVar`, as equinox makes it; the alias
# is made here because pyright reads one only in the module that makes it (and would
# otherwise take the class variables below for arguments of `__init__`).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractLossFamily(eqx.Module):
    """The distribution a registered loss is the negative log-likelihood of.

    Inputs have shape `(*leading, outputs)`: every leading axis indexes examples (or
    tokens), the last axis is the output the loss sums over. Per-example quantities
    keep the leading axes.

    A subclass sets `name` and implements `per_example`, `sample`, `sqrt_hessian`
    and `check_targets`; `eqfisher.register_loss` registers it.

    !!! Example

        A Gaussian with variance 1/4 (precision 4): its curvature is 4 times that of
        `squared_error`.

        ```python
        class Precise(ef.losses.AbstractLossFamily):
            name = "precise_gaussian"

            def per_example(self, inputs, targets):
                return 2.0 * jnp.sum((inputs - targets) ** 2, axis=-1)

            def sample(self, key, inputs):
                return inputs + 0.5 * jax.random.normal(key, inputs.shape)

            def sqrt_hessian(self, inputs):  # S Sᵀ = H = 4 I
                eye = 2.0 * jnp.eye(inputs.shape[-1])
                return jnp.broadcast_to(eye, inputs.shape + eye.shape[-1:])

            def check_targets(self, inputs, targets, caller):
                assert targets.shape == inputs.shape, caller

        targets = jnp.zeros((32, 3))
        precise = lambda m, b: ef.register_loss(Precise(), jax.vmap(m)(b[0]), b[1])
        plain = lambda m, b: ef.squared_error(jax.vmap(m)(b[0]), b[1])

        def dense(loss):
            return ef.curvature(
                loss, model, (x, targets), estimator=ef.GGN(), structure=ef.Dense()
            ).as_matrix()

        assert jnp.allclose(dense(precise), 4 * dense(plain), rtol=1e-5, atol=1e-6)
        ```
    """

    name: AbstractClassVar[str]
    # Whether the loss ignores a shift common to all outputs (softmax does): the
    # data then constrain nothing along it (`eqfisher.laplace.predictive_diagnosis`
    # projects it out). A subclass that is shift-invariant sets it to `True`.
    shift_invariant: ClassVar[bool] = False

    @abc.abstractmethod
    def per_example(
        self, inputs: Float[Array, "*leading out"], targets: Shaped[Array, "..."]
    ) -> Float[Array, "*leading"]:
        """The loss of each example (summed over the output axis)."""

    @abc.abstractmethod
    def sample(
        self, key: PRNGKeyArray, inputs: Float[Array, "*leading out"]
    ) -> Shaped[Array, "..."]:
        """Targets drawn from the model's predictive distribution.

        They must be targets `check_targets` accepts: `eqfisher.FisherMC` checks.
        """

    @abc.abstractmethod
    def sqrt_hessian(
        self, inputs: Float[Array, "*leading out"]
    ) -> Float[Array, "*leading out k"]:
        r"""A factor $S$ with $S S^\top = H$, the per-example Hessian of the loss.

        $H$ is the Hessian with respect to `inputs`. It must not depend on the
        targets (this method does not see them). For a likelihood whose Hessian
        does (a learned variance), return a factor of its expectation over the
        family's own targets, the Fisher: `GGN()` is then the Fisher
        (docs/losses.md, "Loss families").
        """

    @abc.abstractmethod
    def check_targets(self, inputs: Array, targets: Array, caller: str) -> None:
        """Raises `TypeError`/`ValueError` when `targets` do not fit `inputs`."""

    def checked_targets(
        self, inputs: Array, targets: Array, mask: Array, caller: str
    ) -> Array:
        """`targets`, checked where their values (not only their shapes) can be
        wrong; by default unchanged. Called after `check_targets`; `mask` holds the
        per-example weights (0 for padding)."""
        del inputs, mask, caller
        return targets

    def checked_mask(
        self, inputs: Array, targets: Array, mask: Array, caller: str
    ) -> Array:
        """`mask`, checked where the curvature depends on the targets without
        reading them (every estimator reads the mask); by default unchanged. Called
        after `checked_targets`."""
        del inputs, targets, caller
        return mask

    def output_gradient(
        self, inputs: Float[Array, "*leading out"], targets: Shaped[Array, "..."]
    ) -> Float[Array, "*leading out"]:
        """The gradient of each example's loss with respect to its own inputs."""
        # Examples are independent, so the gradient of the sum is per-example.
        return jax.grad(lambda z: jnp.sum(self.per_example(z, targets)))(inputs)

    def hessian_mv(
        self, inputs: Float[Array, "*leading out"], vector: Float[Array, "*leading out"]
    ) -> Float[Array, "*leading out"]:
        """The per-example loss Hessian applied to `vector` (per example)."""
        s = self.sqrt_hessian(inputs)
        return jnp.einsum("...ik,...jk,...j->...i", s, s, vector)
