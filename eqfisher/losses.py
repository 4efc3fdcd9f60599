"""Loss registration: the loss functions users call, and the loss families behind them.

A registered loss does two things at once: it returns the scalar loss (the mean over
every leading axis of a per-example loss, or the mask-weighted mean) and it puts a
*loss tag* on its input. The tag is an identity primitive, invisible to values and to
every derivative, that marks for eqfisher's tracer which array the model outputs, which
loss family sits on top of it, the targets, and the per-example weights.
"""

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, Shaped

from . import _compat, _precision, _refusal


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

        $H$ is the Hessian with respect to `inputs`.
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
        return jnp.where(mask != 0, targets, jnp.zeros_like(targets))

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


def _tag_jvp(primals, tangents, *, family):
    inputs_dot = _compat.instantiate_zeros(tangents[0])
    return loss_tag_p.bind(*primals, family=family), inputs_dot


def _tag_batch(args, dims, *, family):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)
    args = [
        _compat.move_batch_axis(a, d, size) for a, d in zip(args, dims, strict=False)
    ]
    return loss_tag_p.bind(*args, family=family), 0


loss_tag_p = _compat.define_identity_primitive(
    "eqfisher_loss_tag", _tag_jvp, _tag_batch
)
loss_tag_p.__doc__ = """Identity on `inputs`; operands `(inputs, targets, mask)`."""


# The k-th value tag of a program marks the value of the k-th registered loss, so
# that the tracer can see how the value `loss_fn` returns depends on it.
loss_value_tag_p = _compat.define_marker_primitive("eqfisher_loss_value_tag")
loss_value_tag_p.__doc__ = """Identity on a registered loss's scalar value."""


def register_loss(
    family: AbstractLossFamily,
    inputs: Float[Array, "*leading out"],
    targets: Shaped[ArrayLike, "..."],
    mask: Shaped[ArrayLike, "*leading"] | None = None,
    *,
    caller: str = "eqfisher.register_loss",
) -> Float[Array, ""]:
    r"""Registers a loss of the given family on `inputs` and returns its scalar value.

    **Arguments:**

    - `family`: a loss family, e.g. `eqfisher.losses.Categorical()`.
    - `inputs`: the model outputs, shape `(*leading, outputs)`.
    - `targets`: what the family expects (class ids, probabilities, values).
    - `mask`: optional per-example weights of shape `leading` (e.g. 0 for padding
      tokens); the value is then $\sum \text{mask} \cdot \ell / \sum \text{mask}$.
      Weights must be finite and non-negative with a positive sum (a
      `ValueError`, under `jit` Equinox's runtime error, otherwise).

    **Returns:**

    The scalar loss: the (mask-weighted) mean over every leading axis.

    !!! Example

        With the second half of the batch masked out (padding), value and curvature
        are those of the first half (for the exact structures; K-FAC's input factor
        averages over every example: docs/losses.md, "Masks"):

        ```python
        def masked_loss(model, batch):
            x, y, mask = batch
            logits = jax.vmap(model)(x)
            return ef.register_loss(ef.losses.Categorical(), logits, y, mask)

        padded = (x, y, jnp.arange(32) < 16)  # the mask is part of the batch
        half = (x[:16], y[:16])
        assert jnp.allclose(masked_loss(model, padded), loss_fn(model, half))

        def dense(loss, batch):
            return ef.curvature(
                loss, model, batch, estimator=ef.GGN(), structure=ef.Dense()
            ).as_matrix()

        assert jnp.allclose(dense(masked_loss, padded), dense(loss_fn, half), atol=1e-6)
        ```
    """
    inputs = _one_array(inputs, "the outputs (its first argument)", caller)
    targets = _one_array(targets, "the targets (its second argument)", caller)
    mask = None if mask is None else _one_array(mask, "`mask`", caller)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
        raise TypeError(
            f"`{caller}`: the loss must be registered on a floating-point array "
            f"(the model outputs), got dtype {inputs.dtype}; pass the logits or "
            "predictions, not labels."
        )
    if inputs.ndim < 2:
        raise ValueError(
            f"`{caller}`: outputs need shape (*examples, outputs), got "
            f"{inputs.shape}: a loss is registered on a batch of examples. For one "
            "output per example (a batch of scalars), use `outputs[..., None]`; for "
            "one example's outputs (a loss written per example, under `jax.vmap`), "
            "register the batch's outputs instead (`jax.vmap(model)(x)`), or "
            "`outputs[None]` and `targets[None]`."
        )
    for name, array in (("targets", targets), ("mask", mask)):
        if array is not None and jnp.issubdtype(
            jnp.result_type(array), jnp.complexfloating
        ):
            raise TypeError(
                f"`{caller}`: `{name}` must be real, got dtype "
                f"{jnp.result_type(array)} (its imaginary part would be dropped)."
            )
    family.check_targets(inputs, targets, caller)
    leading = inputs.shape[:-1]
    if mask is None:
        mask = jnp.ones(leading, inputs.dtype)
    else:
        if mask.shape != leading:
            raise ValueError(
                f"`{caller}(..., mask=...)`: `mask` must have shape {leading} "
                f"(the leading axes of the outputs), got {mask.shape}."
            )
        mask = mask.astype(inputs.dtype)
        mask = _refusal.refused_where(
            mask,
            (mask < 0) | ~jnp.isfinite(mask) | (jnp.sum(mask) <= 0),
            f"`{caller}(..., mask=...)`: `mask` must be finite and >= 0 with a "
            "positive sum (the value is sum(mask * loss) / sum(mask)); a negative "
            "weight makes the curvature indefinite. Give padding weight 0. (The "
            "functions of `eqfisher.influence` call `loss_fn` on one example at a "
            "time, where a padded example alone has a mask of sum 0: leave padded "
            "examples out of the batches given to them. Under "
            "`eqfisher.optim.kfac_step(..., curvature_batch_size=n)` the "
            "statistics' loss is that of the first n examples: their mask needs a "
            "positive sum too. `eqfisher.dataset_curvature` takes each batch's "
            "loss: leave out a batch that is all padding.)",
        )
    targets = family.checked_targets(inputs, targets, mask, caller)
    mask = family.checked_mask(inputs, targets, mask, caller)
    tagged = loss_tag_p.bind(inputs, targets, mask, family=family)
    # Both sums in float32 at least: a float16 count above 65,504 is inf.
    wide = _precision.at_least_float32(inputs.dtype)
    per_example = _per_example(family, tagged, targets, leading, caller)
    total = jnp.sum(mask * per_example, dtype=wide)
    value = (total / jnp.sum(mask, dtype=wide)).astype(inputs.dtype)
    return loss_value_tag_p.bind(value)


def _one_array(value: Any, name: str, caller: str) -> Array:
    """`value` as one array. A tuple, list or dict holding arrays (the outputs of a
    model that returns several) is refused: `jnp.asarray` stacked one of equal
    shapes into another batch axis, and failed on others in JAX's words."""
    several = isinstance(value, dict) or (
        isinstance(value, tuple | list)
        and any(hasattr(v, "shape") for v in jax.tree_util.tree_leaves(value))
    )
    if several:
        hint = (
            "A model that returns several outputs returns them together: pass the "
            "one the loss is on, e.g. `out[0]` or `out['logits']`."
            if name.startswith("the outputs")
            else "Pass the array itself, e.g. `batch['labels']`."
        )
        raise TypeError(
            f"`{caller}`: {name} must be one array, got a {type(value).__name__} "
            f"(of length {len(value)}). {hint}"
        )
    return jnp.asarray(value)


def _per_example(family, inputs, targets, leading: tuple, caller: str) -> Array:
    """`family.per_example(inputs, targets)`, refused unless one real loss per
    example: a scalar (the sum over examples) gave a value and gradient N times
    the mean's beside the mean's curvature, integers a zero gradient."""
    per_example = family.per_example(inputs, targets)
    if jnp.shape(per_example) != leading or not jnp.issubdtype(
        jnp.result_type(per_example), jnp.floating
    ):
        raise ValueError(
            f"`{caller}`: `{type(family).__name__}.per_example(inputs, targets)` "
            f"must return one real loss per example, shaped {leading} (the leading "
            f"axes of the inputs, the output axis summed), got "
            f"{jnp.result_type(per_example)} of shape {jnp.shape(per_example)}."
        )
    return per_example


def softmax_cross_entropy(
    logits: Float[Array, "*leading classes"],
    labels: Int[ArrayLike, "*leading"] | Float[ArrayLike, "*leading classes"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    """Softmax cross-entropy, registered for curvature.

    **Arguments:**

    - `logits`: shape `(*leading, classes)`.
    - `labels`: integer class ids of shape `leading`, or probabilities shaped like
      `logits`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean (or mask-weighted mean) cross-entropy over every leading axis.

    **Raises:**

    - `TypeError` when the outputs are not floating-point (labels passed as
      logits) or the targets have the wrong kind of dtype.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape; the message gives the shapes expected.
    - `ValueError` (under `jit`, Equinox's runtime error) when an integer label
      lies outside `[0, classes)` where the mask is not 0, or probability labels
      are negative, not finite, or do not sum to 1 (to the square root of their
      dtype's precision) where the mask is not 0. Padding labels (e.g. -1) are
      allowed where `mask` is 0.
    - `ValueError` (under `jit`, Equinox's runtime error) when `mask` has a
      negative or non-finite entry, or sums to 0.

    !!! Example

        ```python
        def loss_fn(model, batch):
            x, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model)(x), y)  # y: class ids
        ```
    """
    return register_loss(
        Categorical(), logits, labels, mask, caller="eqfisher.softmax_cross_entropy"
    )


def sigmoid_cross_entropy(
    logits: Float[Array, "*leading out"],
    targets: Float[ArrayLike, "*leading out"]
    | Int[ArrayLike, "*leading out"]
    | Bool[ArrayLike, "*leading out"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    r"""Sigmoid (binary) cross-entropy summed over outputs, registered for curvature.

    **Arguments:**

    - `logits`: shape `(*leading, outputs)`.
    - `targets`: 0/1 (float, integer or bool), or probabilities, shaped like
      `logits`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean over every leading axis of $\sum_{\text{outputs}} \text{BCE}$.

    **Raises:**

    - `TypeError` when the logits are not floating-point, or the targets or
      `mask` are complex.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape.
    - `ValueError` (under `jit`, Equinox's runtime error) when a target lies
      outside `[0, 1]` where the mask is not 0: the loss is then no likelihood.

    !!! Example

        Three independent yes/no outputs per example:

        ```python
        targets = jax.nn.one_hot(y, 3)  # (32, 3) of 0/1

        def multilabel_loss(model, batch):
            x, t = batch
            return ef.sigmoid_cross_entropy(jax.vmap(model)(x), t)

        logits = jax.vmap(model)(x)
        by_hand = -jnp.mean(
            jnp.sum(
                targets * jax.nn.log_sigmoid(logits)
                + (1 - targets) * jax.nn.log_sigmoid(-logits),
                axis=-1,
            )
        )
        assert jnp.allclose(multilabel_loss(model, (x, targets)), by_hand)
        curv = ef.curvature(
            multilabel_loss,
            model,
            (x, targets),
            estimator=ef.GGN(),
            structure=ef.KFAC(),
        )
        ```
    """
    return register_loss(
        Bernoulli(), logits, targets, mask, caller="eqfisher.sigmoid_cross_entropy"
    )


def squared_error(
    predictions: Float[Array, "*leading out"],
    targets: Float[ArrayLike, "*leading out"],
    *,
    mask: Float[ArrayLike, "*leading"] | Bool[ArrayLike, "*leading"] | None = None,
) -> Float[Array, ""]:
    r"""$\frac{1}{2} \lVert \text{predictions} - \text{targets} \rVert^2$ per example.

    Registered for curvature.

    **Arguments:**

    - `predictions`: shape `(*leading, outputs)`; for a scalar regression use
      `predictions[..., None]`.
    - `targets`: shaped like `predictions`.
    - `mask`: optional per-example weights of shape `leading`.

    **Returns:**

    The mean over every leading axis of
    $\frac{1}{2} \sum_{\text{outputs}} (\text{predictions} - \text{targets})^2$ (a
    unit-variance Gaussian negative log-likelihood up to a constant).

    **Raises:**

    - `TypeError` when the outputs are not floating-point (labels passed as
      logits), or the targets or `mask` are complex.
    - `ValueError` when the outputs have fewer than two axes, or the targets or
      `mask` do not fit their shape; the message gives the shapes expected.

    !!! Example

        ```python
        regressor = eqx.nn.MLP(4, "scalar", 8, 1, key=key)
        t = jnp.sin(x[:, 0])

        def mse_fn(model, batch):
            x, t = batch
            return ef.squared_error(jax.vmap(model)(x)[:, None], t[:, None])

        ggn = ef.ggn_operator(mse_fn, regressor, (x, t))  # here the GGN is JᵀJ / N
        ```
    """
    return register_loss(
        Gaussian(), predictions, targets, mask, caller="eqfisher.squared_error"
    )
