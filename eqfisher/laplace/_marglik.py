"""Tuning the prior precision (and noise) by the Laplace marginal likelihood."""

import functools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree, ScalarLike

from .._curvature import AbstractStructure
from .._refusal import int_hint
from ._blockwise import block_values
from ._posterior import Laplace, Likelihood, fit


def optimize_hyperparameters(
    posterior: Laplace,
    *,
    steps: int = 100,
    learning_rate: ScalarLike = 0.1,
    noise: bool = False,
) -> tuple[Laplace, jax.Array]:
    r"""Maximises `log_marginal_likelihood` over $\log \delta$ (and $\log \sigma$) with
    Adam, compiled.

    The curvature and $\theta^*$ stay fixed: this is the post-hoc tuning of
    laplace-torch's `optimize_prior_precision(method="marglik")`; for the online
    version during training see `marglik_training`.

    **Arguments:**

    - `posterior`: a `Laplace`; its hyperparameters are the starting point.
    - `steps`: Adam steps.
    - `learning_rate`: Adam's step size on the log-hyperparameters.
    - `noise`: also tune $\sigma$ (regression only).

    **Returns:**

    `(posterior, history)`: the tuned `Laplace` and the log marginal likelihood
    before each step, shape `(steps,)`.

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC()
        )
        tuned, history = ef.laplace.optimize_hyperparameters(la, steps=20)
        print(history[0], history[-1])  # the log marginal likelihood rises
        assert tuned.log_marginal_likelihood() > la.log_marginal_likelihood()
        print(tuned.prior_precision)  # one δ per block: layers[0], layers[1]
        ```
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(
            "`eqfisher.laplace.optimize_hyperparameters(..., steps=...)`: a "
            f"positive int, got {steps!r}{int_hint(steps)}."
        )
    _check_rate(learning_rate)
    # An array, not a constant of the compiled loop: a new value would compile it
    # again.
    dtype = jnp.result_type(*jax.tree.leaves(posterior.prior_precision))
    rate = jnp.asarray(learning_rate, dtype)
    return _optimized(posterior, steps=steps, learning_rate=rate, noise=noise)


@eqx.filter_jit
def _optimized(
    posterior: Laplace, *, steps: int, learning_rate: Array, noise: bool
) -> tuple[Laplace, jax.Array]:
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


def _check_rate(learning_rate) -> None:
    if isinstance(learning_rate, jax.core.Tracer):
        return
    try:
        rate = math.nan if isinstance(learning_rate, bool) else float(learning_rate)
    except (TypeError, ValueError):
        rate = math.nan
    if not 0 < rate < math.inf:
        raise ValueError(
            "`eqfisher.laplace.optimize_hyperparameters(..., learning_rate=...)`: "
            f"a positive finite number, got {learning_rate!r}."
        )


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
    hyper_learning_rate: float | int = 0.1,
    burn_in: int = 0,
    where=None,
    prior_precision: ScalarLike = 1.0,
    noise: bool = False,
) -> tuple[PyTree, Laplace, list[float]]:
    r"""Online marginal-likelihood training (Immer et al., 2021), full batch.

    The parameters follow `optimizer` on the MAP objective
    $L(\theta) + \frac{\sigma^2 T}{2N} \sum_b \delta_b \lVert \theta_b \rVert^2$ (the
    negative log joint over $N / (\sigma^2 T)$: the mean loss plus the prior, per
    block, with the current $\sigma$; $\sigma = 1$ for classification); after
    `burn_in` steps and then every `hyper_every` steps, a Laplace posterior is
    fitted at the current parameters and $\delta$ (and $\sigma$ with `noise=True`)
    take `hyper_steps` Adam steps on its log marginal likelihood. The run ends with
    such an update.

    **Arguments:**

    - `loss_fn`, `batch`, `likelihood`, `structure`, `where`: as for `fit`.
      `where` selects the parameters the posterior (and so the prior) covers;
      `optimizer` still trains every parameter, those outside `where` with no
      prior term. To train only the selection, mask the optimiser
      (`optax.masked(opt, ef.filters.optax_mask(model, where))`, and
      `optax.set_to_zero()` on the rest).
    - `model`: the initial model.
    - `optimizer`: an optax optimiser for the parameters.
    - `steps`: parameter steps.
    - `hyper_every`, `hyper_steps`, `hyper_learning_rate`: the hyperparameter
        updates' period, length and Adam step size.
    - `burn_in`: parameter steps before the first hyperparameter update.
    - `prior_precision`: the initial $\delta$.
    - `noise`: also tune $\sigma$ (regression).

    **Returns:**

    `(model, posterior, history)`: the trained model, the `Laplace` posterior at it
    with the tuned hyperparameters, and the log marginal likelihood after each
    hyperparameter update.

    !!! Example

        ```python
        trained, la, history = ef.laplace.marglik_training(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC(),
            optimizer=optax.adam(1e-2), steps=20, hyper_every=10, hyper_steps=20,
        )
        print(history)  # the log marginal likelihood after the updates at steps 10, 20
        print(la.prior_precision)  # the tuned δ of each block
        assert loss_fn(trained, batch) < loss_fn(model, batch)
        ```
    """
    call = "eqfisher.laplace.marglik_training"
    for name, value, low in (("hyper_every", hyper_every, 1), ("steps", steps, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"`{call}(..., {name}=...)`: an int >= {low}, got {value!r}."
            )
    if noise and likelihood != "regression":
        raise ValueError(
            f"`{call}(..., noise=True)` tunes the observation noise of "
            "`likelihood='regression'` only."
        )
    posterior_at = functools.partial(
        _posterior_at,
        loss_fn,
        batch,
        likelihood=likelihood,
        structure=structure,
        where=where,
        prior_precision=prior_precision,
        noise=noise,
    )
    posterior = posterior_at(model, None)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    history = []
    for k in range(1, steps + 1):
        model, state = _parameter_step(
            model, state, posterior, loss_fn, batch, optimizer
        )
        if _updates_hyperparameters(k, steps, burn_in, hyper_every):
            posterior, _ = optimize_hyperparameters(
                posterior_at(model, posterior),
                steps=hyper_steps,
                learning_rate=hyper_learning_rate,
                noise=noise,
            )
            history.append(float(posterior.log_marginal_likelihood()))
    return model, posterior, history


def _posterior_at(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    batch: PyTree,
    model: PyTree,
    previous: Laplace | None,
    *,
    likelihood: Likelihood,
    structure: AbstractStructure,
    where,
    prior_precision: ScalarLike,
    noise: bool,
) -> Laplace:
    """The Laplace posterior at `model`, with the hyperparameters of `previous`
    (the initial `prior_precision` and σ = 1 when there is none)."""
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
    prior: dict[str, ScalarLike] = dict(previous.prior_precision)
    return post.replace(
        prior_precision=prior,
        noise_std=previous.noise_std if noise else None,
    )


def _map_objective(
    model: PyTree,
    posterior: Laplace,
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    batch: PyTree,
) -> Float[Array, ""]:
    """L(θ) + (σ²T/2N) Σ_b δ_b ‖θ_b‖², with δ, σ, T and N from `posterior`: the
    negative log joint, −log p(D|θ) − log p(θ), over N/(σ²T)."""
    prior = eqx.tree_at(lambda p: p.model, posterior, model)
    values = block_values(prior.curvature, prior.mean, "marglik_training")
    # In the hyperparameters' dtype (float32 for a half-precision model), which
    # strict dtype promotion does not mix with the leaves'.
    wide = posterior.noise_std.dtype
    penalty = sum(
        prior.prior_precision[n] * sum(jnp.sum(jnp.square(x.astype(wide))) for x in v)
        for n, v in values.items()
    )
    scale = posterior.noise_std**2 * posterior.temperature / posterior.num_data
    return loss_fn(model, batch).astype(wide) + 0.5 * scale * penalty


@eqx.filter_jit
def _parameter_step(
    model: PyTree,
    state: PyTree,
    posterior: Laplace,
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    batch: PyTree,
    optimizer: optax.GradientTransformation,
) -> tuple[PyTree, PyTree]:
    """One `optimizer` step on the MAP objective: the new model and state."""
    grads = eqx.filter_grad(_map_objective)(model, posterior, loss_fn, batch)
    with jax.numpy_dtype_promotion("standard"):
        updates, state = optimizer.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array)
        )
    return eqx.apply_updates(model, updates), state


def _updates_hyperparameters(k: int, steps: int, burn_in: int, every: int) -> bool:
    """Whether parameter step `k` (from 1) is followed by a hyperparameter update:
    after `burn_in` steps, then every `every` steps, and after the last."""
    return (k >= burn_in and (k - burn_in) % every == 0) or k == steps
