"""`Laplace`: a Gaussian posterior N(θ*, Λ⁻¹) with Λ = (N/(σ²T))·C + diag(δ) built
from a `Curvature` C of the mean training loss, and `fit`, which builds it."""

import math
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree, ScalarLike

from .._curvature import (
    GGN,
    AbstractEstimator,
    AbstractExamples,
    AbstractStructure,
    Curvature,
    IndependentExamples,
    curvature,
)
from .._precision import at_least_float32
from .._refusal import int_hint, refused_where
from .._tracer import loss_tags_jvp
from ..losses import Bernoulli, Categorical, Gaussian
from ._blockwise import (
    block_size,
    block_values,
    map_blocks,
    prepare_block,
    sqrt_inverse_mv,
)


Likelihood = Literal["classification", "regression"]

# The likelihood each built-in loss family is the negative log of.
_LIKELIHOODS = {
    Categorical: "classification",
    Bernoulli: "classification",
    Gaussian: "regression",
}


def _positive(value, dtype, call: str, name: str) -> Array:
    """`value` as an array of `dtype`, after checking it is positive and finite (at
    run time, with `eqx.error_if`, when it is traced)."""
    message = f"`{call}(..., {name}=...)`: `{name}` must be positive and finite"
    if isinstance(value, jax.core.Tracer):
        bad = ~(jnp.isfinite(value) & (value > 0))
        return eqx.error_if(jnp.asarray(value, dtype), bad, message + ".")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{message}, got {value!r}.")
    return jnp.asarray(value, dtype)


def _prior_dict(curv: Curvature, prior_precision, dtype) -> dict[str, Array]:
    names = [n for n, _ in curv.leaf_indices]
    if isinstance(prior_precision, dict):
        if set(prior_precision) != set(names):
            raise ValueError(
                "`eqfisher.laplace.Laplace(..., prior_precision=...)`: a dict needs "
                f"one scalar per curvature block, keyed {sorted(names)}; got keys "
                f"{sorted(prior_precision)}."
            )
        values = {n: prior_precision[n] for n in names}
    else:
        values = {n: prior_precision for n in names}
    for n, v in values.items():
        scalar = isinstance(v, int | float | np.number) or eqx.is_array(v)
        if not scalar or jnp.shape(v) != ():
            got = f"shape {jnp.shape(v)}" if scalar else type(v).__name__
            raise ValueError(
                "`eqfisher.laplace.Laplace(..., prior_precision=...)`: expected a "
                f"scalar (or a dict of scalars), got {got} for `{n}`. The prior is "
                "one precision per block, keyed by the curvature's block names; a "
                "precision per parameter (laplace-torch's) is not offered."
            )
    call = "eqfisher.laplace.Laplace"
    return {n: _positive(v, dtype, call, "prior_precision") for n, v in values.items()}


class Laplace(eqx.Module):
    r"""A Laplace approximation $\mathcal{N}(\theta^*, \Lambda^{-1})$ of the posterior
    over (some) parameters.

    The posterior precision is
    $\Lambda = \frac{N}{\sigma^2 T} C + \operatorname{diag}(\delta)$, where $C$ is the
    curvature of the *mean* training loss (eqfisher's convention; hence the factor
    $N$, the number of training examples), $\sigma$ the observation noise (regression
    only; 1 for classification), $T$ the temperature and $\delta$ the prior
    precision, one scalar per curvature block. Every product, solve, log-determinant
    and sample works block by block through the blocks' own methods
    (eigendecompositions for K-FAC and EKFAC), so any structure and any `where=`
    subset are covered.

    **Fields:**

    - `curvature`: the `Curvature` $C$ of the mean loss at $\theta^*$.
    - `model`: the model at $\theta^*$ (the posterior mean for the selected
      parameters).
    - `loss`: the mean training loss $L(\theta^*)$ (the registered loss, without
      prior).
    - `num_data`: $N$, the number of examples the mean loss averages over.
    - `prior_precision`: a dict from block name to the scalar $\delta$ of that block.
    - `noise_std`: $\sigma$ (regression); 1 for classification.
    - `temperature`: $T$.
    - `likelihood`: static; `"classification"` or `"regression"`.
    - `num_outputs`: static; the output size $D$ (the Gaussian normaliser).
    - `shift_invariant`: static; whether the likelihood ignores a shift common to
      all outputs (softmax), or `None` (not known: classification with several
      outputs is then taken as softmax).

    !!! Example

        ```python
        # What `ef.laplace.fit` builds, from a curvature of the mean loss.
        curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
        la = ef.laplace.Laplace(
            curv, model, loss=loss_fn(model, batch), num_data=32,
            likelihood="classification", prior_precision=1.0,
        )
        back = la.covariance_mv(la.precision_mv(grads))  # Λ⁻¹ Λ g = g
        for p, q in zip(jax.tree.leaves(back), jax.tree.leaves(grads)):
            assert jnp.allclose(p, q, rtol=1e-3, atol=1e-6)
        samples = la.sample(key, 100)
        print(samples.layers[0].weight.shape)  # (100, 8, 4): 100 draws of the weight
        ```
    """

    curvature: Curvature
    model: PyTree
    loss: Float[Array, ""]
    num_data: Float[Array, ""]
    prior_precision: dict[str, Float[Array, ""]]
    noise_std: Float[Array, ""]
    temperature: Float[Array, ""]
    likelihood: Likelihood = eqx.field(static=True)
    num_outputs: int = eqx.field(static=True)
    shift_invariant: bool | None = eqx.field(static=True)

    def __init__(
        self,
        curvature: Curvature,
        model: PyTree,
        *,
        loss: ScalarLike,
        num_data: ScalarLike,
        likelihood: Likelihood,
        prior_precision: ScalarLike | dict[str, ScalarLike] = 1.0,
        noise_std: ScalarLike | None = None,
        temperature: ScalarLike = 1.0,
        num_outputs: int = 1,
        shift_invariant: bool | None = None,
    ):
        r"""**Arguments:**

        - `curvature`: from `eqfisher.curvature(...)` on the mean training loss at
            the trained parameters (any estimator, structure and `where`).
        - `model`: the trained model.
        - `loss`: the mean training loss at `model` (negative log-likelihood per
            example, as registered: `softmax_cross_entropy`, `squared_error`, ...).
        - `num_data`: $N$, the number of training examples.
        - `likelihood`: `"classification"` (categorical or Bernoulli) or
            `"regression"` (Gaussian, with `squared_error`'s
            $\frac{1}{2} \lVert y - f \rVert^2$).
        - `prior_precision`: $\delta$, a positive scalar, or a dict with one per block
            (the names of `curvature.blocks`: per layer with a block structure).
        - `noise_std`: $\sigma > 0$, regression only (default 1).
        - `temperature`: $T > 0$.

        `num_data`, `prior_precision`, `noise_std` and `temperature` that are not
        positive and finite raise `ValueError` (under `jit`, Equinox's runtime
        error).
        - `num_outputs`: $D$, regression only: the Gaussian normaliser is
            $N D \log(\sigma \sqrt{2\pi})$. `fit` sets it from the registered loss;
            built by hand, pass it for a model of several outputs (the default, 1,
            is a one-output model's, and a wrong $D$ shifts the log marginal
            likelihood and the $\sigma$ it tunes to).
        - `shift_invariant`: whether the likelihood ignores a shift common to all
            outputs: `True` for softmax, `False` for independent sigmoids (several
            labels per example) and regression; `None` (the default) takes
            classification with several outputs as softmax. `fit` sets it from the
            registered loss. Only `predictive_diagnosis` reads it.
        """
        if likelihood not in ("classification", "regression"):
            raise ValueError(
                "`eqfisher.laplace.Laplace(..., likelihood=...)`: expected "
                f"'classification' or 'regression', got {likelihood!r}."
            )
        if likelihood == "classification" and noise_std is not None:
            raise ValueError(
                "`eqfisher.laplace.Laplace(..., noise_std=...)` applies to "
                "`likelihood='regression'` only; leave it out for classification."
            )
        leaves = jax.tree_util.tree_leaves(curvature.structure)
        dtype = jnp.result_type(*[s.dtype for s in leaves])
        # N, δ, σ, T and the loss in at least float32, as the curvature's
        # statistics are: in bfloat16, P log(N/σ²T) is off by several units and
        # N above 65,504 overflows float16.
        dtype = at_least_float32(dtype)
        # Solves, log-determinants and samples are repeated (per example, output,
        # sample, optimisation step): K-FAC's eigendecompositions are done once.
        prepared = {n: prepare_block(b) for n, b in curvature.blocks.items()}
        self.curvature = Curvature(
            prepared, curvature.leaf_indices, curvature.structure, curvature.leaf_slices
        )
        self.model = model
        self.loss = jnp.asarray(loss, dtype)
        self.num_data = _positive(
            num_data, dtype, "eqfisher.laplace.Laplace", "num_data"
        )
        self.prior_precision = _prior_dict(curvature, prior_precision, dtype)
        call = "eqfisher.laplace.Laplace"
        sigma = 1.0 if noise_std is None else noise_std
        self.noise_std = _positive(sigma, dtype, call, "noise_std")
        self.temperature = _positive(temperature, dtype, call, "temperature")
        self.likelihood = likelihood
        self.num_outputs = int(num_outputs)
        self.shift_invariant = shift_invariant

    @property
    def curvature_scale(self) -> Float[Array, ""]:
        r"""$N / (\sigma^2 T)$: the factor on $C$ in the posterior precision."""
        return self.num_data / (self.noise_std**2 * self.temperature)

    @property
    def mean(self) -> PyTree:
        r"""$\theta^*$: the selected parameters (others `None`), the posterior mean."""
        params = eqx.filter(self.model, eqx.is_inexact_array)
        return jax.tree_util.tree_map(
            lambda p, s: None if s is None else p, params, self.curvature.structure
        )

    def replace(
        self,
        *,
        prior_precision: ScalarLike | dict[str, ScalarLike] | None = None,
        noise_std: ScalarLike | None = None,
    ) -> "Laplace":
        r"""This posterior with other hyperparameters (differentiable in them).

        **Arguments:**

        - `prior_precision`: a scalar or a dict per block; `None` keeps it.
        - `noise_std`: $\sigma$ (regression); `None` keeps it.

        **Returns:**

        A `Laplace`.
        """
        out = self
        if prior_precision is not None:
            dtype = self.loss.dtype
            new = _prior_dict(self.curvature, prior_precision, dtype)
            out = eqx.tree_at(lambda p: p.prior_precision, out, new)
        if noise_std is not None:
            if self.likelihood != "regression":
                raise ValueError(
                    "`Laplace.replace(noise_std=...)` applies to "
                    "`likelihood='regression'` only."
                )
            sigma = _positive(
                noise_std, self.loss.dtype, "Laplace.replace", "noise_std"
            )
            out = eqx.tree_at(lambda p: p.noise_std, out, sigma)
        return out

    def covariance_mv(self, vector: PyTree) -> PyTree:
        r"""$\Lambda^{-1} v$, block by block through each block's exact damped solve.

        **Arguments:**

        - `vector`: a PyTree like `mean` (unselected leaves `None`).

        **Returns:**

        $\Lambda^{-1} v$, a PyTree like `vector`.
        """
        scale = self.curvature_scale

        def fn(name, block, parts):
            # (s B + δ I)⁻¹ v = (B + δ/s I)⁻¹ (v / s), with v / s in at least
            # float32, as the blocks are: a block returns its operand's dtype, and
            # in a float16 model's, the solve at δ/s and then the division by s
            # (N above 65,504) overflowed: a covariance of 0, inf or NaN.
            wide = tuple(x.astype(at_least_float32(x.dtype)) / scale for x in parts)
            out = block.solve(wide, self.prior_precision[name] / scale)
            return tuple(y.astype(x.dtype) for x, y in zip(parts, out))

        return map_blocks(self.curvature, vector, fn, "Laplace.covariance_mv")

    def precision_mv(self, vector: PyTree) -> PyTree:
        r"""$\Lambda v$.

        **Arguments:**

        - `vector`: a PyTree like `mean`.

        **Returns:**

        $\Lambda v$, a PyTree like `vector`.
        """
        scale = self.curvature_scale

        def fn(name, block, parts):
            out = block.mv(parts)
            prior = self.prior_precision[name]
            return tuple(
                (scale * y + prior * x).astype(x.dtype) for x, y in zip(parts, out)
            )

        return map_blocks(self.curvature, vector, fn, "Laplace.precision_mv")

    def log_det_precision(self) -> Float[Array, ""]:
        r"""$\log\det \Lambda$: the sum over blocks $b$ (of $P_b$ parameters each) of

        $$
        P_b \log \frac{N}{\sigma^2 T}
        + \log\det\Bigl(B_b + \frac{\delta_b \sigma^2 T}{N} I\Bigr).
        $$
        """
        scale = self.curvature_scale
        return jnp.asarray(
            sum(
                block_size(b) * jnp.log(scale)
                + b.logdet(self.prior_precision[n] / scale)
                for n, b in self.curvature.blocks.items()
            )
        )

    def log_likelihood(self) -> Float[Array, ""]:
        r"""$\log p(D \mid \theta^*)$: $-N L / (\sigma^2 T)$, minus
        $N D \log(\sigma \sqrt{2\pi})$ for regression."""
        value = -self.num_data * self.loss / (self.noise_std**2 * self.temperature)
        if self.likelihood == "regression":
            norm = jnp.log(self.noise_std * math.sqrt(2 * math.pi))
            value = value - self.num_data * self.num_outputs * norm
        return value

    def log_marginal_likelihood(self) -> Float[Array, ""]:
        r"""The Laplace estimate of $\log p(D \mid \delta, \sigma)$.

        $$
        \log p(D \mid \theta^*)
        - \frac{1}{2} \sum_b \delta_b \lVert \theta^*_b \rVert^2
        + \frac{1}{2} \sum_b P_b \log \delta_b
        - \frac{1}{2} \log\det \Lambda
        $$

        (the $2\pi$ terms of prior and posterior cancel), as in laplace-torch. It is
        differentiable in `prior_precision` and `noise_std`.

        **Returns:**

        A scalar.
        """
        values = block_values(self.curvature, self.mean, "Laplace")
        scatter = sum(
            self.prior_precision[n]
            * sum(jnp.sum(jnp.square(x.astype(self.loss.dtype))) for x in v)
            for n, v in values.items()
        )
        log_det_prior = sum(
            block_size(b) * jnp.log(self.prior_precision[n])
            for n, b in self.curvature.blocks.items()
        )
        return self.log_likelihood() - 0.5 * (
            self.log_det_precision() - log_det_prior + scatter
        )

    def sample(self, key: PRNGKeyArray, num_samples: int) -> PyTree:
        r"""Parameters drawn from the posterior, stacked on a leading axis.

        Each block's sample is $\theta^*_b + (s B_b + \delta_b I)^{-1/2} z$, $z$
        standard normal, with the square root from the block's eigendecomposition
        (K-FAC and EKFAC through their eigenbases; `Full` through `eigh`).

        **Arguments:**

        - `key`: a PRNG key.
        - `num_samples`: how many.

        **Returns:**

        A PyTree like `mean` whose leaves have a leading axis `num_samples`.
        """
        bad = isinstance(num_samples, bool) or not isinstance(num_samples, int)
        if bad or num_samples < 1:
            raise ValueError(
                "`Laplace.sample(key, num_samples)`: `num_samples` must be a "
                f"positive int, got {num_samples!r}{int_hint(num_samples)}."
            )
        structure = self.curvature.structure
        scale = self.curvature_scale

        def one(k):
            leaves, treedef = jax.tree_util.tree_flatten(structure)
            keys = jax.random.split(k, len(leaves))
            z = jax.tree_util.tree_unflatten(
                treedef,
                [
                    jax.random.normal(kk, s.shape, s.dtype)
                    for kk, s in zip(keys, leaves)
                ],
            )

            def fn(name, block, parts):
                prior = self.prior_precision[name]
                return sqrt_inverse_mv(block, parts, scale, prior)

            noise = map_blocks(self.curvature, z, fn, "Laplace.sample")
            # In the parameters' dtypes: a `Diagonal()` block of a half-precision
            # model draws float32 noise.
            return jax.tree_util.tree_map(
                lambda m, e: (m.astype(e.dtype) + e).astype(m.dtype), self.mean, noise
            )

        # vmap, not lax.map: the factorisations are computed once, not per sample.
        return jax.vmap(one)(jax.random.split(key, num_samples))

    def combine(self, theta: PyTree) -> PyTree:
        """The model with its selected parameters replaced by `theta`.

        **Arguments:**

        - `theta`: a PyTree like `mean`.

        **Returns:**

        The model.
        """
        rest = jax.tree_util.tree_map(
            lambda p, s: p if s is None else None,
            eqx.filter(self.model, eqx.is_inexact_array),
            self.curvature.structure,
        )
        static = eqx.filter(self.model, eqx.is_inexact_array, inverse=True)
        return eqx.combine(theta, rest, static)


# Compiled, as `eqfisher.curvature` is: run eagerly, a check of `loss_fn`'s (a mask
# of sum 0) failed inside JAX's callback, its message wrapped in an internal error.
@eqx.filter_jit
def _registered(loss_fn: Callable, model: PyTree, batch: PyTree) -> tuple:
    """The losses `loss_fn` registers at `model` and `batch`."""
    zeros = jax.tree_util.tree_map(
        jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array)
    )
    return loss_tags_jvp(loss_fn)(model, batch, zeros)[0]


def _fit_curvature(loss_fn, model, batch, **options) -> Curvature:
    """`eqfisher.curvature` for `fit`, whose refusals then name `fit` too."""
    try:
        return curvature(loss_fn, model, batch, **options)
    except (ValueError, TypeError) as e:
        e.add_note(
            "(from `eqfisher.laplace.fit`, which passes its `loss_fn`, `model`, "
            "`batch`, `estimator`, `structure`, `where`, `key` and `examples` to "
            "`eqfisher.curvature`)"
        )
        raise


def fit(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    likelihood: Likelihood,
    structure: AbstractStructure,
    estimator: AbstractEstimator = GGN(),  # noqa: B008 (an immutable Module)
    where=None,
    key: PRNGKeyArray | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (immutable)
    prior_precision: ScalarLike | dict[str, ScalarLike] = 1.0,
    noise_std: ScalarLike | None = None,
    temperature: ScalarLike = 1.0,
) -> Laplace:
    """A Laplace posterior around the trained `model`, from one batch (the data set).

    The curvature is `eqfisher.curvature(loss_fn, model, batch, ...)`; N, D and the
    mean loss are read from the registered loss (N: its number of examples, or the
    sum of its mask).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar` with one registered loss.
    - `model`: the trained model (the MAP).
    - `batch`: the training data.
    - `likelihood`: `"classification"` or `"regression"`.
    - `structure`, `estimator`, `where`, `key`, `examples`: as for
      `eqfisher.curvature` (`examples=eqfisher.InteractingExamples()` for a model
      whose examples interact, such as BatchNorm in training mode;
      `IndependentExamples(axis=1)` for time-major data).
    - `prior_precision`, `noise_std`, `temperature`: as for `Laplace`.

    **Returns:**

    A `Laplace`.

    **Raises:**

    `ValueError` when `loss_fn` registers other than exactly one loss or returns
    it times a factor other than 1 (`fit` multiplies by N itself), when
    `likelihood` contradicts the registered loss (`softmax_cross_entropy` and
    `sigmoid_cross_entropy` are `"classification"`, `squared_error` is
    `"regression"`; a custom family is not checked), when `prior_precision`,
    `noise_std` or `temperature` is not positive, and the errors of
    `eqfisher.curvature`.

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC()
        )
        la, _ = ef.laplace.optimize_hyperparameters(la, steps=20)  # prior precision
        print(la.log_marginal_likelihood())
        ```
    """
    losses = _registered(loss_fn, model, batch)
    if len(losses) != 1:
        raise ValueError(
            f"`eqfisher.laplace.fit(loss_fn, ...)`: `loss_fn` registers {len(losses)} "
            "losses; a Laplace posterior needs exactly one. Build the `Laplace` "
            "yourself from a curvature, the loss value and N."
        )
    (registered,) = losses
    expected = _LIKELIHOODS.get(type(registered.family))
    if expected is not None and likelihood != expected:
        raise ValueError(
            f"`eqfisher.laplace.fit(..., likelihood={likelihood!r})`: `loss_fn` "
            f"registers a `{type(registered.family).__name__}` loss (family "
            f"{registered.family.name!r}), whose likelihood is {expected!r}; pass "
            f"`likelihood={expected!r}`."
        )
    curv = _fit_curvature(
        loss_fn,
        model,
        batch,
        estimator=estimator,
        structure=structure,
        where=where,
        key=key,
        examples=examples,
    )
    # N·C + δI is built here from the mean loss's curvature: a loss already
    # multiplied by N (or any factor) would count it twice.
    coefficient = jnp.sum(registered.coefficient)  # over a `vmap`'s lanes
    shown = (
        "a factor"
        if isinstance(coefficient, jax.core.Tracer)
        else f"{float(coefficient):.6g}"
    )
    curv = refused_where(
        curv,
        jnp.abs(coefficient - 1) > 1e-6,
        "`eqfisher.laplace.fit(loss_fn, ...)`: `loss_fn` must return the mean "
        "registered loss (coefficient 1), but returns it times "
        f"{shown}; `fit` reads N from the registered loss and "
        "builds N·C/T + δI itself. Drop the factor (to weight the likelihood, "
        "pass `temperature=T`).",
    )
    return Laplace(
        curv,
        model,
        loss=registered.value(),
        # Counted in float32 at least: above 65,504 a float16 count is inf.
        num_data=jnp.sum(
            registered.mask, dtype=at_least_float32(registered.mask.dtype)
        ),
        likelihood=likelihood,
        prior_precision=prior_precision,
        noise_std=noise_std,
        temperature=temperature,
        num_outputs=registered.inputs.shape[-1],
        shift_invariant=type(registered.family).shift_invariant,
    )
