"""The softmax cross-entropy's family: class ids or probability vectors."""

import jax
import jax.numpy as jnp

from .. import _refusal
from ._family import AbstractLossFamily


def _at_least_int32(dtype) -> jnp.dtype:
    """`dtype` if it is an integer of 32 bits or more, else int32: class ids
    compared with a class count or an iota of classes (which would wrap in int8)."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.int32)


class Categorical(AbstractLossFamily):
    r"""Softmax cross-entropy; targets are class ids or probability vectors.

    Probability targets must sum to one over the classes (where the mask is not
    0): the Hessian in the logits, and so the GGN, is $(\sum t)(\operatorname{diag}
    p - p p^\top)$, which eqfisher computes for $\sum t = 1$.

    !!! Example

        ```python
        family = ef.losses.Categorical()
        z, label = jnp.array([[1.0, -0.5, 2.0]]), jnp.array([2])  # one example
        assert jnp.allclose(family.per_example(z, label), -jax.nn.log_softmax(z)[:, 2])

        # The Hessian in the logits, diag(p) - p pᵀ, as S Sᵀ:
        S = family.sqrt_hessian(z)[0]
        H = jax.hessian(lambda z: family.per_example(z, label)[0])(z)[0, :, 0, :]
        assert jnp.allclose(S @ S.T, H, atol=1e-6)
        ```
    """

    name = "categorical"
    shift_invariant = True

    def per_example(self, inputs, targets):
        log_p = jax.nn.log_softmax(inputs, axis=-1)
        if jnp.issubdtype(targets.dtype, jnp.integer):
            # The label's entry picked by a select, not a gather: the gather's
            # derivative is a scatter, a loop over the examples on the CPU.
            # At least int32: an iota in a narrow label dtype (int8) would wrap.
            wide = _at_least_int32(targets.dtype)
            classes = jax.lax.broadcasted_iota(wide, log_p.shape, log_p.ndim - 1)
            label = targets[..., None].astype(wide)
            return -jnp.sum(jnp.where(classes == label, log_p, 0), axis=-1)
        return -jnp.sum(targets * log_p, axis=-1)

    def sample(self, key, inputs):
        # By the inverse CDF: one uniform per example against the cumulative
        # softmax, faster than `jax.random.categorical`'s Gumbel noise over every
        # class for large vocabularies (figures in benchmarks/RESULTS.md).
        # At least float32: half-precision cumulative sums hold 2-3 digits.
        wide = jnp.finfo(inputs.dtype).bits >= 32
        z = inputs if wide else inputs.astype(jnp.float32)
        c = jnp.cumsum(jax.nn.softmax(z, axis=-1), axis=-1)
        u = jax.random.uniform(key, c.shape[:-1] + (1,), c.dtype) * c[..., -1:]
        return jnp.minimum(jnp.sum(c <= u, axis=-1), inputs.shape[-1] - 1)

    def output_gradient(self, inputs, targets):
        # softmax(z)·Σt − t, in closed form: cheaper than differentiating the gather.
        p = jax.nn.softmax(inputs, axis=-1)
        if jnp.issubdtype(targets.dtype, jnp.integer):
            return p - jax.nn.one_hot(targets, inputs.shape[-1], dtype=inputs.dtype)
        t = targets.astype(inputs.dtype)
        return p * jnp.sum(t, axis=-1, keepdims=True) - t

    def sqrt_hessian(self, inputs):
        # H = diag(p) - p pᵀ = S Sᵀ with S = diag(√p) - p √pᵀ (uses Σ p = 1).
        p = jax.nn.softmax(inputs, axis=-1)
        sqrt_p = jnp.sqrt(p)
        # Explicit broadcast: callers may run with `jax_numpy_rank_promotion="raise"`.
        eye = jnp.broadcast_to(
            jnp.eye(p.shape[-1], dtype=p.dtype), p.shape + p.shape[-1:]
        )
        return eye * sqrt_p[..., None, :] - p[..., :, None] * sqrt_p[..., None, :]

    def check_targets(self, inputs, targets, caller):
        batch = inputs.shape[:-1]
        expected = (
            f"`labels` must be integer class ids of shape logits.shape[:-1] = {batch} "
            "(an integer dtype, e.g. `labels.astype(jnp.int32)`) or probability "
            f"`labels` (floats) of the shape of `logits` {inputs.shape}"
        )
        if jnp.issubdtype(targets.dtype, jnp.integer):
            if targets.shape != batch:
                hint = (
                    " Drop the trailing axis of length 1: `labels[..., 0]`."
                    if targets.shape == batch + (1,)
                    else ""
                )
                raise ValueError(
                    f"`{caller}(logits, labels)`: {expected}; got integer `labels` "
                    f"of shape {targets.shape}.{hint}"
                )
        elif jnp.issubdtype(targets.dtype, jnp.floating):
            if targets.shape != inputs.shape:
                if targets.shape == batch:
                    hint = (
                        " These look like class ids stored as floats: class ids "
                        "must be integers, pass `labels.astype(jnp.int32)`."
                    )
                elif targets.shape == batch + (1,):
                    hint = (
                        " These look like class ids stored as floats with a trailing "
                        "axis of length 1: class ids must be integers of shape "
                        f"{batch}, pass `labels[..., 0].astype(jnp.int32)`."
                    )
                else:
                    hint = ""
                raise ValueError(
                    f"`{caller}(logits, labels)`: {expected}; got float `labels` of "
                    f"shape {targets.shape}.{hint}"
                )
        else:
            raise TypeError(
                f"`{caller}(logits, labels)`: `labels` must be integer class ids or "
                f"float probabilities, got dtype {targets.dtype}."
            )

    def checked_targets(self, inputs, targets, mask, caller):
        if not jnp.issubdtype(targets.dtype, jnp.integer):
            return targets
        classes = inputs.shape[-1]
        # Padding ids (e.g. -1) are allowed where the mask is 0; they are replaced by
        # class 0 there so that the (zero-weighted) loss stays finite.
        # At least int32: `classes` would wrap in a narrow label dtype (300 in int8).
        wide = targets.astype(_at_least_int32(targets.dtype))
        bad = ((wide < 0) | (wide >= classes)) & (mask != 0)
        message = (
            f"`{caller}(logits, labels)`: integer `labels` must be class ids in "
            f"[0, {classes}) (logits.shape[-1] = {classes}); for padding, give those "
            "examples weight 0 with `mask=`."
        )
        targets = _refusal.refused_where(
            targets, bad, message, lambda: str(int(targets[bad][0]))
        )
        # A scalar 0, not `zeros_like`: under `Explicit` mesh axes a replicated mask
        # and sharded labels could not meet in `where` otherwise.
        return jnp.where(mask != 0, targets, 0)

    def checked_mask(self, inputs, targets, mask, caller):
        if jnp.issubdtype(targets.dtype, jnp.integer):
            return mask
        # The GGN and the Fisher read neither the labels nor their sum: the check
        # rides on the mask, which every estimator reads.
        tolerance = float(jnp.finfo(targets.dtype).eps) ** 0.5
        total = jnp.sum(targets, axis=-1)
        # `~(... <= ...)`: a NaN or infinite label fails it too.
        off = ~(jnp.abs(total - 1) <= tolerance) | jnp.any(targets < 0, axis=-1)
        bad = off & (mask != 0)
        return _refusal.refused_where(
            mask,
            bad,
            f"`{caller}(logits, labels)`: probability `labels` must be finite and "
            "non-negative and sum to 1 over the classes (the last axis) wherever "
            "`mask` is not 0; the curvature assumes it. Normalise them "
            "(`labels / labels.sum(-1, keepdims=True)`); "
            "give padding examples weight 0 with `mask=` (not rows of "
            "zeros), weight examples with `mask=`, and use "
            "`eqfisher.sigmoid_cross_entropy` for several labels per example.",
        )
