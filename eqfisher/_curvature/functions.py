"""The public functions that build a `Curvature`: `curvature` and
`value_grad_and_curvature` (loss, gradient and curvature from one forward pass)."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._config import Config, current_config
from .._refusal import check_flag
from .._tracer import Returns, StagedLoss
from ..filters import AbstractFilter
from .builder import Builder, check_args
from .estimators import AbstractEstimator
from .examples import AbstractExamples, IndependentExamples
from .fits import measuring_now
from .operator import Curvature
from .structures import AbstractStructure


def curvature(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    key: PRNGKeyArray | None = None,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (an immutable Module)
) -> Curvature:
    """The curvature of the value `loss_fn(model, batch)` returns.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar`, with its loss registered
      (`eqfisher.softmax_cross_entropy`, ...).
    - `model`, `batch`: PyTrees; the model's inexact arrays are the parameters.
    - `estimator`: `GGN()`, `FisherExact()`, `FisherMC(samples=...)` or
      `EmpiricalFisher()`.
    - `structure`: `Dense()`, `BlockDiagonal()`, `Diagonal()`, `KFAC()`, `EKFAC()`,
      `PerLayer(...)` (structures per layer, chosen with filters), or a subclass of
      `AbstractStructure`.
    - `key`: a PRNG key, needed by `FisherMC`.
    - `where`: a filter (`eqfisher.filters`) restricting the parameters covered.
    - `examples`: `IndependentExamples(axis=0)` (default) or
      `InteractingExamples()`: how the batch's examples relate inside `loss_fn`,
      for the structures that need per-example vectors.

    **Returns:**

    A `Curvature`, a lineax operator over the (selected) parameters.

    **Raises:**

    - `TypeError` when `estimator`, `structure` or `examples` is not one of
      eqfisher's types.
    - `ValueError` when `FisherMC` gets no `key`, when `where` selects no
      parameter, or when `loss_fn` registers no loss, its value is not affine in
      the registered losses, or one enters it with a negative constant
      coefficient (`-loss`); each message names the fix.
    - `eqx.EquinoxRuntimeError` (a check on the values, when the curvature is
      computed) when examples interact inside `loss_fn` (BatchNorm statistics)
      under `IndependentExamples()`, or a weight from the batch makes a loss's
      coefficient negative; the message names the fix.

    !!! Example

        ```python
        model = eqx.nn.MLP(2, 3, 8, 1, key=jax.random.key(0))
        batch = (jnp.ones((16, 2)), jnp.zeros(16, dtype=int))  # inputs, labels

        def loss_fn(model, batch):
            x, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model)(x), y)

        curv = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        print(curv.blocks.keys())  # layers[0], layers[1]: KroneckerFactored
        print(curv.as_matrix().shape)  # (51, 51)
        ```
    """
    check_args("eqfisher.curvature", estimator, structure, key, examples)
    return _curvature_jit(
        loss_fn,
        model,
        batch,
        estimator,
        structure,
        key,
        where,
        examples,
        current_config(),
        measuring_now(),
    )


# Compiled even when called eagerly: the interpreted program would otherwise run op
# by op. Inside an outer `jit` this is an ordinary nested call.
@eqx.filter_jit
def _curvature_jit(
    loss_fn,
    model,
    batch,
    estimator,
    structure,
    key,
    where,
    examples,
    config: Config,
    measuring: bool,
):
    # `config` is a static argument: a changed setting (`eqfisher.configure`)
    # compiles anew instead of reusing a program traced under another. So is
    # `measuring` (`memory_estimate`'s trace, which lets every size through): a
    # later call traces anew, and its blocks' size is checked.
    del config, measuring
    caller = "eqfisher.curvature"
    builder = Builder(
        StagedLoss(loss_fn, caller), estimator, structure, where, caller, examples
    )
    return builder(model, batch, key, value_and_grad=False)[0]


def value_grad_and_curvature(
    loss_fn: Callable,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    has_aux: bool = False,
    surrogate: bool = False,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (an immutable Module)
) -> Callable:
    """Loss, gradient and curvature from one forward pass and one stacked VJP.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, returning the scalar loss, or
      `(loss, aux)` with `has_aux=True`, or `(loss, gradient_surrogate)` with
      `surrogate=True` (gradients are those of the surrogate, the value reported is
      the loss, curvature that of the registered losses).
    - `estimator`, `structure`, `where`, `examples`: as for `eqfisher.curvature`.

    **Returns:**

    A function `(model, batch, *, key=None) -> (value, grads, curvature)`; `value`
    is `(loss, aux)` with `has_aux`; `grads` is shaped like `eqx.filter_grad`'s.
    For K-FAC the curvature statistics come from the same forward and VJP as the
    gradient; structures that need exact per-example Jacobians (`Dense`,
    `BlockDiagonal`, `Diagonal`, EKFAC's scales, leaves in no layer) add a
    per-example pass.

    **Raises:**

    `ValueError` when both `has_aux` and `surrogate` are set; at the first call,
    the errors of `eqfisher.curvature`.

    !!! Example

        With `model`, `batch` and `loss_fn` as in `eqfisher.curvature`'s example:

        ```python
        vgc = ef.value_grad_and_curvature(
            loss_fn, estimator=ef.FisherMC(), structure=ef.KFAC()
        )
        loss, grads, curv = vgc(model, batch, key=jax.random.key(1))
        ```
    """
    caller = "eqfisher.value_grad_and_curvature"
    staged = StagedLoss(
        loss_fn, caller, _returns(caller, has_aux, surrogate), takes_has_aux=True
    )
    cotangent_fn = functools.partial(_cotangents, which=1 if surrogate else 0)

    def fn(model, batch, *, key=None):
        check_args(caller, estimator, structure, key, examples)
        return compiled(model, batch, key, current_config())

    @eqx.filter_jit
    def compiled(model, batch, key, config: Config):
        del config  # static: see `_curvature_jit`
        builder = Builder(staged, estimator, structure, where, caller, examples)
        curv, main = builder(
            model, batch, key, value_and_grad=True, cotangent_fn=cotangent_fn
        )
        value = _value(loss_fn, model, batch, main.program_outputs, has_aux)
        return value, _like_params(model, main.grads), curv

    return fn


def value_grad_then_curvature(
    loss_fn: Callable,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    has_aux: bool = False,
    surrogate: bool = False,
    where: AbstractFilter | PyTree | None = None,
    examples: AbstractExamples = IndependentExamples(),  # noqa: B008 (an immutable Module)
    caller: str = "eqfisher.value_grad_and_curvature",
) -> Callable:
    """`value_grad_and_curvature(loss_fn, ...)` in two parts, for a step that
    computes the curvature only at some steps (`eqfisher.optim.kfac_step`).

    `fn(model, batch, key=None) -> (value, grads, curvature)`, called inside jit,
    runs the forward of the whole batch and the gradient (`value` is `(loss, aux)`
    with `has_aux`; with `surrogate`, the loss, and the surrogate's gradient);
    `curvature()` the rest of `value_grad_and_curvature`'s work, from the same
    forward, and returns its `Curvature`. Called inside a
    `lax.cond`, only that rest is conditional: the model is compiled once, its
    forward's residuals are the `cond`'s operands. `caller` is the name errors give.
    """
    staged = StagedLoss(
        loss_fn, caller, _returns(caller, has_aux, surrogate), takes_has_aux=True
    )
    cotangent_fn = functools.partial(_cotangents, which=1 if surrogate else 0)
    builder = Builder(staged, estimator, structure, where, caller, examples)

    def fn(model, batch, key=None):
        check_args(caller, estimator, structure, key, builder.examples)
        forward = builder.linearise(
            model, batch, value_and_grad=True, cotangent_fn=cotangent_fn
        )

        def curvature() -> Curvature:
            return builder.curvature(forward, key)[0]

        outputs = forward.lin.program_outputs
        assert outputs is not None  # linearised with `value_and_grad`
        value = _value(loss_fn, model, batch, outputs, has_aux)
        return value, _like_params(model, forward.grads), curvature

    return fn


def _returns(caller: str, has_aux: bool, surrogate: bool) -> Returns:
    """What `loss_fn` returns, as `StagedLoss` names it: `"aux"`, `"surrogate"` or
    `"loss"`."""
    check_flag(caller, "has_aux", has_aux)
    check_flag(caller, "surrogate", surrogate)
    if has_aux and surrogate:
        raise ValueError(f"`{caller}`: pass at most one of `has_aux` and `surrogate`.")
    return "aux" if has_aux else "surrogate" if surrogate else "loss"


def _cotangents(outputs, which: int) -> tuple:
    """The cotangent that pulls back the gradient of `outputs[which]` alone: ones
    there, zeros (`float0` for integer outputs) elsewhere."""
    # Outputs may be Python scalars (an aux built from shapes): `jnp.shape`.
    return tuple(
        (jnp.ones_like(o) if i == which else jnp.zeros_like(o))
        if jnp.issubdtype(jnp.result_type(o), jnp.inexact)
        else np.zeros(jnp.shape(o), jax.dtypes.float0)
        for i, o in enumerate(outputs)
    )


def _value(loss_fn, model, batch, program_outputs, has_aux: bool):
    """The loss, or `(loss, aux)` with `has_aux`: aux rebuilt in `loss_fn`'s
    output structure, its arrays from the program's outputs and its other leaves
    (static, as `eqx.filter_value_and_grad` keeps them) from an evaluation of
    shapes."""
    loss = program_outputs[0]
    if not has_aux:
        return loss
    out_shape = eqx.filter_eval_shape(loss_fn, model, batch)
    leaves, treedef = jax.tree_util.tree_flatten(out_shape[1])
    arrays = iter(program_outputs[1:])
    leaves = [
        next(arrays) if isinstance(x, jax.ShapeDtypeStruct) else x for x in leaves
    ]
    return loss, jax.tree_util.tree_unflatten(treedef, leaves)


def _like_params(model: PyTree, leaves) -> PyTree:
    """The gradient's leaves in the structure of `eqx.filter_grad`'s result."""
    params = eqx.filter(model, eqx.is_inexact_array)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)
