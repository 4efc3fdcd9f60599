"""A cheap diagnosis of a Laplace predictive: how large its output variance is against
the outputs' own scale, and how much of the prior's variance the data removed."""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._blockwise import block_values
from ._posterior import Laplace, Likelihood
from ._predictive import linearise


def _median(x: Array) -> float:
    return float(jnp.median(x))


class PredictiveDiagnosis(eqx.Module):
    r"""The linearised predictive's variance on some inputs, against the scale of the
    outputs and against the prior's variance.

    Built by `predictive_diagnosis`. Per example $x$ and output $l$, with $J$ the
    Jacobian of the outputs in the selected parameters:

    - `variance`: $(J \Lambda^{-1} J^\top)_{ll}$, the GLM predictive variance;
    - `prior_variance`: $(J \operatorname{diag}(\delta)^{-1} J^\top)_{ll}$, the
      variance the prior alone gives the linearised network (one $\delta$ per
      block); `variance` never exceeds it.
    - `prior_share`: $\operatorname{tr}(P J \Lambda^{-1} J^\top P) /
      \operatorname{tr}(P J \operatorname{diag}(\delta)^{-1} J^\top P)$, the share
      of the prior's variance the data left, with $P$ the projection off a shift
      common to all logits where the likelihood ignores it (softmax over several
      classes: no data constrain it), the identity otherwise (independent
      sigmoids, regression). Near 1 the data
      barely constrain the directions the outputs depend on, and the prior
      precision sets the predictive variance; near 0 the curvature does.

    **Fields:**

    - `mean`: $f(x; \theta^*)$, shape `(batch, D)`.
    - `variance`, `prior_variance`: shape `(batch, D)`.
    - `prior_share`: shape `(batch,)`.
    - `noise_std`: $\sigma$ (regression; 1 for classification).
    - `likelihood`: static, as the posterior's.
    - `shift_invariant`: static; whether the outputs are softmax logits (the
      posterior's `shift_invariant`, or with `None` there, classification with
      several outputs).

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.Dense()
        )
        weak = ef.laplace.predictive_diagnosis(la.replace(prior_precision=1e-4), x)
        strong = ef.laplace.predictive_diagnosis(la.replace(prior_precision=1e4), x)
        print(weak.summary())  # a warning, and what to do
        assert jnp.median(weak.std_ratio) > jnp.median(strong.std_ratio)
        assert jnp.all(weak.probit_factor < strong.probit_factor)
        ```
    """

    mean: Float[Array, "batch out"]
    variance: Float[Array, "batch out"]
    prior_variance: Float[Array, "batch out"]
    prior_share: Float[Array, " batch"]
    noise_std: Float[Array, ""]
    likelihood: Likelihood = eqx.field(static=True)
    shift_invariant: bool = eqx.field(static=True)

    @property
    def output_scale(self) -> Float[Array, " batch"]:
        r"""The scale the predictive standard deviation is compared with, per example.

        Softmax classification: the standard deviation of the logits across classes
        (softmax ignores a shift common to all classes). Sigmoid classification: the
        root mean square of the logits (the logit's size, for one output).
        Regression: $\sigma$, the noise.
        """
        if self.shift_invariant:
            return jnp.std(self.mean, axis=-1)
        if self.likelihood == "classification":  # independent sigmoids
            return jnp.sqrt(jnp.mean(jnp.square(self.mean), axis=-1))
        return jnp.broadcast_to(self.noise_std, self.mean.shape[:1])

    @property
    def std_ratio(self) -> Float[Array, " batch"]:
        """The predictive standard deviation (root mean variance over the outputs)
        divided by `output_scale`, per example."""
        return jnp.sqrt(jnp.mean(self.variance, axis=-1)) / self.output_scale

    @property
    def probit_factor(self) -> Float[Array, "batch out"]:
        r"""$1 / \sqrt{1 + \frac{\pi}{8} \sigma^2_l}$: the factor by which the probit
        approximation (`eqfisher.laplace.probit`) scales each logit."""
        return 1 / jnp.sqrt(1 + math.pi / 8 * self.variance)

    def summary(self) -> str:
        """Medians over the examples, and advice where the predictive is likely to be
        much less confident than the network itself: where the predictive standard
        deviation exceeds `output_scale` (median `std_ratio` above 1) and, for
        classification, probit at least halves the logits (median `probit_factor`
        below 0.5).

        **Returns:**

        A few lines of text.
        """
        std = _median(jnp.sqrt(jnp.mean(self.variance, axis=-1)))
        scale = _median(self.output_scale)
        share = _median(self.prior_share)
        what = "logit spread" if self.likelihood == "classification" else "noise σ"
        lines = [
            f"predictive std {std:.3g} against a {what} of {scale:.3g} "
            f"(median ratio {_median(self.std_ratio):.3g}); the data removed "
            f"{1 - share:.1%} of the prior's variance (median)."
        ]
        broad = _median(self.std_ratio) > 1
        if self.likelihood == "classification":
            factor = _median(jnp.mean(self.probit_factor, axis=-1))
            lines.append(f"probit scales the logits by {factor:.3g} (median).")
            broad = broad and factor < 0.5
        if not broad:
            return "\n".join(lines)
        lines.append(
            "The predictive variance dominates the outputs' scale: a GLM predictive "
            "will be far less confident than the network. See 'When the posterior "
            "makes predictions worse' in the Laplace docs: tune the prior precision "
            "(or a temperature) on validation data, give each layer its own prior, "
            "or cover fewer parameters."
        )
        if share > 0.5:
            lines.append(
                "The prior sets most of that variance (the data barely constrain "
                "these directions): a larger prior precision shrinks it directly."
            )
        else:
            lines.append(
                "The data set most of that variance (the curvature is small in these "
                "directions, as where softmax outputs saturate): a larger prior "
                "precision narrows it only once it is comparable to N times the "
                "curvature; a temperature below 1 narrows it in proportion."
            )
        return "\n".join(lines)


@eqx.filter_jit  # as `glm_predictive`
def predictive_diagnosis(
    posterior: Laplace,
    x: PyTree,
    *,
    apply: Callable[[PyTree, PyTree], Float[Array, " out"]] | None = None,
    chunk_size: int | None = None,
) -> PredictiveDiagnosis:
    r"""How broad the linearised predictive is on inputs `x`, and why.

    For each example and output $l$, one VJP gives the row $J^\top e_l$; the
    predictive variance is $\langle J^\top e_l, \Lambda^{-1} J^\top e_l \rangle$
    (`Laplace.covariance_mv`) and the prior's is
    $\sum_b \lVert (J^\top e_l)_b \rVert^2 / \delta_b$. The cost is that of the
    diagonal of `glm_predictive`'s covariance, so a few dozen inputs are enough: the
    point is to see, before predicting, whether the posterior's variance swamps the
    outputs (probit then flattens every prediction) and whether it is the prior that
    sets it. `PredictiveDiagnosis.summary()` says so in words.

    **Arguments:**

    - `posterior`: a `Laplace`.
    - `x`: inputs, a PyTree with a leading example axis.
    - `apply`: `apply(model, example) -> outputs` of shape `(D,)`; `None` (the
        default) calls `model(example)`.
    - `chunk_size`: examples per vectorised step (default: all at once).

    **Returns:**

    A `PredictiveDiagnosis`.

    !!! Example

        ```python
        la = ef.laplace.fit(
            loss_fn, model, batch, likelihood="classification", structure=ef.KFAC()
        )
        diagnosis = ef.laplace.predictive_diagnosis(la, x[:8])
        print(diagnosis.summary())
        _, cov = ef.laplace.glm_predictive(la, x[:8])
        assert jnp.allclose(diagnosis.variance, jnp.diagonal(cov, axis1=1, axis2=2))
        assert jnp.all(diagnosis.variance <= diagnosis.prior_variance * (1 + 1e-6))
        ```
    """

    def one(xi):
        out, _, vjp = linearise(posterior, apply, xi)

        def variances(e):
            """eᵀ J Λ⁻¹ Jᵀ e and eᵀ J diag(δ)⁻¹ Jᵀ e."""
            (row,) = vjp(e)
            parts = block_values(
                posterior.curvature, row, "eqfisher.laplace.predictive_diagnosis"
            )
            # In the hyperparameters' dtype (float32 for a half-precision model),
            # which strict dtype promotion does not mix with the leaves'.
            wide = posterior.noise_std.dtype
            prior = sum(
                sum(jnp.sum(jnp.square(p.astype(wide))) for p in v)
                / posterior.prior_precision[n]
                for n, v in parts.items()
            )
            solved = jax.tree_util.tree_leaves(posterior.covariance_mv(row))
            leaves = jax.tree_util.tree_leaves(row)
            pairs = zip(leaves, solved)
            return sum(
                jnp.sum(a.astype(wide) * b.astype(wide)) for a, b in pairs
            ), prior

        d = out.shape[0]
        eye = jnp.eye(d, dtype=out.dtype)
        variance, prior = jax.vmap(variances)(eye)
        if _shift_invariant(posterior, d):
            # The rows of P = I - 11ᵀ/D: tr(P Σ P) = Σ_l (P e_l)ᵀ Σ (P e_l).
            centred, centred_prior = jax.vmap(variances)(eye - 1 / d)
            share = jnp.sum(centred) / jnp.sum(centred_prior)
        else:
            share = jnp.sum(variance) / jnp.sum(prior)
        return out, variance, prior, share

    mean, variance, prior, share = jax.lax.map(one, x, batch_size=chunk_size)
    return PredictiveDiagnosis(
        mean,
        variance,
        prior,
        share,
        posterior.noise_std,
        posterior.likelihood,
        _shift_invariant(posterior, mean.shape[-1]),
    )


def _shift_invariant(posterior: Laplace, outputs: int) -> bool:
    """The posterior's `shift_invariant`, or where it is not known (`None`), whether
    it is classification with several outputs (taken as softmax)."""
    if posterior.shift_invariant is not None:
        return posterior.shift_invariant
    return posterior.likelihood == "classification" and outputs > 1
