"""Tuning the prior precision (and noise) by the Laplace marginal likelihood."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree, ScalarLike

from .._structures import AbstractStructure
from ._blockwise import block_values
from ._posterior import Laplace, Likelihood, fit


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


def marglik_training(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    likelihood: Likelihood,
    structure: AbstractStructure,
    optimizer: optax.GradientTransformation,
    steps: int,
    hyper_every: int = 50,
    hyper_steps: int = 50,
    hyper_learning_rate: float = 0.1,
    burn_in: int = 0,
    where=None,
    prior_precision: ScalarLike = 1.0,
    noise: bool = False,
) -> tuple[PyTree, Laplace, list[float]]:
    """Online marginal-likelihood training (Immer et al., 2021), full batch.

    The parameters follow `optimizer` on the MAP objective
    L(θ) + (1/2N) Σ_b δ_b ‖θ_b‖² (the mean loss plus the prior, per block); after
    `burn_in` steps and then every `hyper_every` steps, a Laplace posterior is fitted
    at the current parameters and δ (and σ with `noise=True`) take `hyper_steps`
    Adam steps on its log marginal likelihood. The run ends with such an update.

    **Arguments:**

    - `loss_fn`, `batch`, `likelihood`, `structure`, `where`: as for `fit`.
    - `model`: the initial model.
    - `optimizer`: an optax optimiser for the parameters.
    - `steps`: parameter steps.
    - `hyper_every`, `hyper_steps`, `hyper_learning_rate`: the hyperparameter
        updates' period, length and Adam step size.
    - `burn_in`: parameter steps before the first hyperparameter update.
    - `prior_precision`: the initial δ.
    - `noise`: also tune σ (regression).

    **Returns:**

    `(model, posterior, history)`: the trained model, the `Laplace` posterior at it
    with the tuned hyperparameters, and the log marginal likelihood after each
    hyperparameter update.
    """

    def laplace_at(model, previous):
        post = fit(
            loss_fn,
            model,
            batch,
            likelihood=likelihood,
            structure=structure,
            where=where,
            prior_precision=prior_precision if previous is None else 1.0,
        )
        if previous is None:
            return post
        return post.replace(
            prior_precision=previous.prior_precision,
            noise_std=previous.noise_std if noise else None,
        )

    @eqx.filter_jit
    def step(model, state, posterior):
        def objective(model):
            prior = eqx.tree_at(lambda p: p.model, posterior, model)
            values = block_values(prior.curvature, prior.mean, "marglik_training")
            penalty = sum(
                prior.prior_precision[n] * sum(jnp.sum(jnp.square(x)) for x in v)
                for n, v in values.items()
            )
            return loss_fn(model, batch) + 0.5 * penalty / posterior.num_data

        grads = eqx.filter_grad(objective)(model)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimizer.update(
                grads, state, eqx.filter(model, eqx.is_inexact_array)
            )
        return eqx.apply_updates(model, updates), state

    posterior = laplace_at(model, None)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    history = []
    for k in range(1, steps + 1):
        model, state = step(model, state, posterior)
        if (k >= burn_in and (k - burn_in) % hyper_every == 0) or k == steps:
            posterior = laplace_at(model, posterior)
            posterior, _ = optimize_hyperparameters(
                posterior,
                steps=hyper_steps,
                learning_rate=hyper_learning_rate,
                noise=noise,
            )
            history.append(float(posterior.log_marginal_likelihood()))
    return model, posterior, history
