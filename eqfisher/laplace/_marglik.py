"""Tuning the prior precision (and noise) by the Laplace marginal likelihood."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._posterior import Laplace


@eqx.filter_jit
def optimize_hyperparameters(
    posterior: Laplace,
    *,
    steps: int = 100,
    learning_rate: float = 0.1,
    noise: bool = False,
) -> tuple[Laplace, jax.Array]:
    """Maximises `log_marginal_likelihood` over log δ (and log σ) with Adam, compiled.

    The curvature and θ* stay fixed: this is the post-hoc tuning of laplace-torch's
    `optimize_prior_precision(method="marglik")`; for the online version during
    training see `marglik_training`.

    **Arguments:**

    - `posterior`: a `Laplace`; its hyperparameters are the starting point.
    - `steps`: Adam steps.
    - `learning_rate`: Adam's step size on the log-hyperparameters.
    - `noise`: also tune σ (regression only).

    **Returns:**

    `(posterior, history)`: the tuned `Laplace` and the log marginal likelihood
    before each step, shape `(steps,)`.
    """
    if noise and posterior.likelihood != "regression":
        raise ValueError(
            "`eqfisher.laplace.optimize_hyperparameters(..., noise=True)` tunes the "
            "observation noise of `likelihood='regression'` only."
        )
    logs = {"prior": jax.tree_util.tree_map(jnp.log, posterior.prior_precision)}
    if noise:
        logs["noise"] = jnp.log(posterior.noise_std)

    def build(logs):
        sigma = jnp.exp(logs["noise"]) if noise else None
        prior = jax.tree_util.tree_map(jnp.exp, logs["prior"])
        return posterior.replace(prior_precision=prior, noise_std=sigma)

    def objective(logs):
        return -build(logs).log_marginal_likelihood()

    opt = optax.adam(learning_rate)

    def step(carry, _):
        logs, state = carry
        value, grads = jax.value_and_grad(objective)(logs)
        # optax's Adam computes `b1 ** count` (a Python float to an int32 power),
        # which strict dtype promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, state = opt.update(grads, state)
        return (optax.apply_updates(logs, updates), state), -value

    (logs, _), history = jax.lax.scan(step, (logs, opt.init(logs)), length=steps)
    return build(logs), history
