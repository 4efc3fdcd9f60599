"""Predictives of a `Laplace` posterior: the linearised (GLM) mean and covariance of
the outputs, probit and Laplace-bridge link approximations, Monte-Carlo samples."""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._refusal import check_count, refused_where
from ._posterior import Laplace


def _call(model, x):
    return model(x)


_ADVICE = (
    "`x` must have a leading example axis (one input: `x[None]`), and "
    "`apply(model, example)` return the outputs of one example, a vector (D,)."
)


def _applied(apply: Callable | None, model: PyTree, xi: PyTree) -> Array:
    """One example's outputs `(D,)` (`apply=None` calls `model(example)`), with
    the advice above where applying fails or gives another shape: JAX's message
    alone ("matmul input operand 1 must have ndim at least 1" for an `x` without
    its example axis) names neither `x` nor the fix."""
    apply = _call if apply is None else apply
    try:
        out = apply(model, xi)
    except (TypeError, ValueError) as e:
        raise ValueError(
            "`eqfisher.laplace`: applying the model to one example of `x` (`x` "
            f"sliced along its leading axis) failed ({type(e).__name__}: {e}). "
            f"{_ADVICE}"
        ) from e
    if jnp.ndim(out) != 1:
        raise ValueError(
            "`eqfisher.laplace`: one example's outputs must be a vector (D,), got "
            f"shape {jnp.shape(out)}. {_ADVICE}"
        )
    return out


def linearise(
    posterior: Laplace,
    apply: Callable[[PyTree, PyTree], Float[Array, " out"]] | None,
    xi: PyTree,
) -> tuple[Float[Array, " out"], Callable, Callable]:
    """`(outputs, jvp, vjp)` of one example's outputs in the selected parameters,
    linearised at the posterior mean (`apply=None` calls `model(example)`)."""
    out, jvp = jax.linearize(
        lambda t: _applied(apply, posterior.combine(t), xi), posterior.mean
    )
    return out, jvp, jax.linear_transpose(jvp, posterior.mean)


# Compiled: called outside `jit`, each `lax.map` inside would be compiled again
# at every call (its functions are new closures).
@eqx.filter_jit
def glm_predictive(
    posterior: Laplace,
    x: PyTree,
    *,
    apply: Callable[[PyTree, PyTree], Float[Array, " out"]] | None = None,
    chunk_size: int | None = None,
    output_chunk_size: int | None = None,
) -> tuple[Float[Array, "batch out"], Float[Array, "batch out out"]]:
    r"""The linearised predictive: outputs $f(x; \theta^*)$ and their covariance
    $J \Lambda^{-1} J^\top$.

    Per example, the network is linearised once (`jax.linearize`); for each output
    $l$, one VJP gives the row $J^\top e_l$, `Laplace.covariance_mv` maps it through
    $\Lambda^{-1}$ block by block, and one JVP gives the column
    $J \Lambda^{-1} J^\top e_l$. The Jacobian is never formed: memory is
    $\text{chunk\_size} \cdot \text{output\_chunk\_size} \cdot P$ for $P$ selected
    parameters (outputs run `output_chunk_size` at a time, examples `chunk_size`
    at a time, both through `jax.lax.map`). The covariance is of the function
    values; for regression add $\sigma^2$ for the noisy targets.

    **Arguments:**

    - `posterior`: a `Laplace`.
    - `x`: inputs, a PyTree with a leading example axis.
    - `apply`: `apply(model, example) -> outputs` of shape `(D,)`; `None` (the
        default) calls `model(example)`.
    - `chunk_size`: examples per vectorised step (default: all at once).
    - `output_chunk_size`: outputs per vectorised step (default: all D at once).

    **Returns:**

    `(mean, covariance)` of shapes `(batch, D)` and `(batch, D, D)`.

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC()
        )
        mean, cov = ef.laplace.glm_predictive(la, x[:5])
        print(mean.shape, cov.shape)  # (5, 3) (5, 3, 3)
        assert jnp.allclose(mean, jax.vmap(model)(x[:5]), atol=1e-6)  # f(x; θ*)
        probs = ef.laplace.probit(mean, cov)  # class probabilities
        ```
    """

    def one(xi):
        out, jvp, vjp = linearise(posterior, apply, xi)

        def column(e):
            (row,) = vjp(e)
            return jvp(posterior.covariance_mv(row))

        eye = jnp.eye(out.shape[0], dtype=out.dtype)
        cov = jax.lax.map(column, eye, batch_size=output_chunk_size)
        # Symmetric in exact arithmetic; averaged so that rounding keeps it so.
        return out, 0.5 * (cov + cov.T)

    return jax.lax.map(one, x, batch_size=chunk_size)


def predictive_samples(
    posterior: Laplace,
    x: PyTree,
    key: PRNGKeyArray,
    num_samples: int,
    *,
    linearised: bool = True,
    apply: Callable[[PyTree, PyTree], Float[Array, " out"]] | None = None,
) -> Float[Array, "samples batch out"]:
    r"""Outputs under parameters drawn from the posterior (`Laplace.sample`).

    Linearised: $f(x; \theta^*) + J (\theta - \theta^*)$, one JVP per sample, never
    forming $J$.
    Otherwise the network itself at each sample.

    **Arguments:**

    - `posterior`: a `Laplace`.
    - `x`: inputs with a leading example axis.
    - `key`: a PRNG key.
    - `num_samples`: how many parameter samples.
    - `linearised`: the GLM predictive (default) or the network.
    - `apply`: as for `glm_predictive`.

    **Returns:**

    Outputs of shape `(num_samples, batch, D)`.

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC()
        )
        f = ef.laplace.predictive_samples(la, x[:5], key, 100)
        print(f.shape)  # (100, 5, 3)
        probs = ef.laplace.softmax_average(f)  # the Monte-Carlo predictive
        ```
    """
    # Checked here: under `_predictive_samples`' `jit` a NumPy count is traced.
    check_count(num_samples, "num_samples", "eqfisher.laplace.predictive_samples")
    return _predictive_samples(posterior, x, key, num_samples, linearised, apply)


# Compiled: called outside `jit`, each `lax.map` inside would be compiled again
# at every call (its functions are new closures).
@eqx.filter_jit
def _predictive_samples(posterior, x, key, num_samples, linearised, apply):
    theta = posterior.mean
    samples = posterior.sample(key, num_samples)

    def outputs(t):
        model = posterior.combine(t)
        return jax.vmap(lambda xi: _applied(apply, model, xi))(x)

    def one(sample):
        if not linearised:
            return outputs(sample)
        delta = jax.tree_util.tree_map(lambda s, m: s - m, sample, theta)
        f, jv = jax.jvp(outputs, (theta,), (delta,))
        return f + jv

    return jax.lax.map(one, samples)


def probit(
    mean: Float[Array, "batch classes"],
    covariance: Float[Array, "batch classes classes"],
) -> Float[Array, "batch classes"]:
    r"""MacKay's probit approximation:
    $\operatorname{softmax}(\mu / \sqrt{1 + \frac{\pi}{8} \operatorname{diag} \Sigma})$.

    **Arguments:**

    - `mean`, `covariance`: from `glm_predictive`.

    **Returns:**

    Class probabilities.

    **Raises:**

    `ValueError` for one output: these predictives are for softmax classifiers
    (for one sigmoid output, `jax.nn.sigmoid(mean / jnp.sqrt(1 + jnp.pi / 8 *
    var))`), or shapes other than `glm_predictive`'s.

    !!! Example

        ```python
        mean = jnp.array([[2.0, 0.0, -2.0]])  # one input's logits
        print(ef.laplace.probit(mean, jnp.zeros((1, 3, 3))))  # softmax(mean)
        # Uncertain logits (variance 10 each) give less confident probabilities.
        print(ef.laplace.probit(mean, 10 * jnp.eye(3)[None]))
        ```
    """
    _check_gaussian("probit", mean, covariance)
    var = jnp.diagonal(covariance, axis1=-2, axis2=-1)
    return jax.nn.softmax(mean / jnp.sqrt(1 + math.pi / 8 * var), axis=-1)


def _check_gaussian(caller: str, mean: Array, covariance: Array) -> None:
    """Refuses a `covariance` that is not one (classes, classes) matrix per
    example of `mean`: per-class variances (batch, classes) gave the diagonal of
    that array, mixing the examples' variances, with no error."""
    shape = jnp.shape(mean)
    if len(shape) != 2 or jnp.shape(covariance) != shape + shape[-1:]:
        raise ValueError(
            f"`eqfisher.laplace.{caller}(mean, covariance)`: `mean` must have shape "
            "(batch, classes) and `covariance` (batch, classes, classes), as "
            f"`glm_predictive` returns them; got {shape} and "
            f"{jnp.shape(covariance)}. For per-class variances `var`, pass "
            "`jax.vmap(jnp.diag)(var)`."
        )
    _check_classes(caller, shape[-1])


def _check_classes(caller: str, classes: int) -> None:
    """Refuses one output: a softmax over one logit is 1 whatever the logit (a
    binary sigmoid classifier gave probabilities of 1, or NaN from the bridge)."""
    if classes == 1:
        raise ValueError(
            f"`eqfisher.laplace.{caller}`: a softmax over one output is 1 whatever "
            "its value; these predictives are for softmax classifiers. For one "
            "sigmoid output, the probit approximation is "
            "`jax.nn.sigmoid(mean / jnp.sqrt(1 + jnp.pi / 8 * var))` with `var` "
            "the diagonal of the covariance."
        )


def laplace_bridge(
    mean: Float[Array, "batch classes"],
    covariance: Float[Array, "batch classes classes"],
) -> Float[Array, "batch classes"]:
    """The Laplace bridge (Hobbhahn et al., 2022): the mean of the Dirichlet matched
    to the logits' Gaussian, after laplace-torch's zero-mean correction.

    **Arguments:**

    - `mean`, `covariance`: from `glm_predictive`.

    **Returns:**

    Class probabilities.

    **Raises:**

    `ValueError` (under `jit`, Equinox's runtime error) for a covariance without
    variance along the sum of the logits or in a class (a zero covariance: use
    `jax.nn.softmax(mean)`), and as `probit` for one output.

    !!! Example

        ```python
        mean = jnp.array([[2.0, 0.0, -2.0]])  # one input's logits
        sure = ef.laplace.laplace_bridge(mean, 0.1 * jnp.eye(3)[None])
        unsure = ef.laplace.laplace_bridge(mean, jnp.diag(jnp.array([10.0, 0.1, 0.1]))[None])
        print(sure, unsure)  # [[0.81 0.14 0.05]] [[0.68 0.24 0.08]]
        # Variance on the leading logit lowers its probability.
        ```
    """
    _check_gaussian("laplace_bridge", mean, covariance)
    k = mean.shape[-1]
    row = jnp.sum(covariance, axis=-1)
    total = jnp.sum(covariance, axis=(-2, -1))[..., None]
    # A covariance without variance along the sum of the logits (zero, say) has
    # no zero-mean correction, and one without variance in a class none for its
    # Dirichlet: NaN, where laplace-torch returns all ones.
    total = refused_where(
        total,
        ~(total > 0),
        "`eqfisher.laplace.laplace_bridge(mean, covariance)`: the bridge needs "
        "variance along the sum of the logits (its zero-mean correction divides "
        "by it); for a covariance of zero (no uncertainty) the probabilities are "
        "`jax.nn.softmax(mean)`.",
    )
    mean = mean - row * jnp.sum(mean, axis=-1, keepdims=True) / total
    cov = covariance - row[..., :, None] * row[..., None, :] / total[..., None]
    var = jnp.diagonal(cov, axis1=-2, axis2=-1)
    var = refused_where(
        var,
        ~(var > 0),
        "`eqfisher.laplace.laplace_bridge(mean, covariance)`: a class has no "
        "variance left after the zero-mean correction, so its Dirichlet parameter "
        "is infinite; the bridge needs variance in every class.",
    )
    sum_exp = jnp.sum(jnp.exp(-mean), axis=-1, keepdims=True)
    alpha = (1 - 2 / k + jnp.exp(mean) / k**2 * sum_exp) / var
    return alpha / jnp.sum(alpha, axis=-1, keepdims=True)


def softmax_average(
    samples: Float[Array, "samples batch classes"],
) -> Float[Array, "batch classes"]:
    """The Monte-Carlo predictive: the mean of softmax over output samples.

    **Arguments:**

    - `samples`: from `predictive_samples`.

    **Returns:**

    Class probabilities.

    !!! Example

        ```python
        # Two samples of one input's logits that disagree: the average is unsure.
        samples = jnp.array([[[4.0, 0.0]], [[0.0, 4.0]]])  # (samples, batch, classes)
        print(ef.laplace.softmax_average(samples))  # [[0.5, 0.5]]
        ```
    """
    if jnp.ndim(samples) != 3:
        raise ValueError(
            "`eqfisher.laplace.softmax_average(samples)`: `samples` must be "
            "`(samples, batch, classes)`, as `predictive_samples` gives them, got "
            f"shape {jnp.shape(samples)}; for one input's samples, add its batch "
            "axis: `samples[:, None]`."
        )
    _check_classes("softmax_average", jnp.shape(samples)[-1])
    return jnp.mean(jax.nn.softmax(samples, axis=-1), axis=0)
