"""The public functions on a model's layers: `find_layers` (what the tracer
detects) and `layer_vjp` (each layer's primals and cotangents from one pass)."""

from collections.abc import Callable

import jax
from jaxtyping import Array, Float, PyTree

from .._refusal import check_flag
from .capture import StagedLoss, split, stage_loss
from .program import VarMap, points
from .results import LayerData, LayerReport


def find_layers(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    strict: bool = False,
) -> LayerReport:
    """Traces `loss_fn(model, batch)` and reports the layers it finds.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar`, registering its loss with
      `eqfisher.softmax_cross_entropy` etc.
    - `model`: any PyTree (usually an `eqx.Module`); its inexact arrays are the
      parameters.
    - `batch`: any PyTree.
    - `strict`: raise a `ValueError` naming the parameters in no layer.

    **Returns:**

    A `LayerReport` with `.layers` (name, kind, parameter paths) and `.unmatched`
    (paths of parameters in no layer; they get a diagonal block). `print(report)`
    shows a table.

    **Raises:**

    `ValueError` when `loss_fn` registers no loss, when its value is not affine in
    the registered losses, or (with `strict=True`) when some parameters are in no
    layer; each message names the fix.

    !!! Example

        ```python
        report = ef.find_layers(loss_fn, model, batch)
        print(report)  # layers[0], layers[1]: dense, with their parameters
        assert [layer.kind for layer in report.layers] == ["dense", "dense"]
        ```
    """
    check_flag("eqfisher.find_layers", "strict", strict)
    processed = stage_loss(loss_fn, split(model, batch), caller="eqfisher.find_layers")
    report = processed.report()
    if strict and report.unmatched:
        detail = "; ".join(f"{p} ({r})" for p, r in processed.unmatched)
        raise ValueError(
            "`eqfisher.find_layers(..., strict=True)`: parameters in no layer: "
            f"{detail}. Pass `strict=False` to give them diagonal blocks."
        )
    return report


class _LayerVjp:
    def __init__(self, staged: StagedLoss):
        self.staged = staged

    def __call__(self, model: PyTree, batch: PyTree):
        s = split(model, batch)
        processed = self.staged.stage(s)
        layers = processed.layers
        reads = [v for r in layers for v in (r.inputs, r.outputs)]

        coefs = processed.coefficients(s.inputs)

        def forward(p_leaves, perturb):
            ev = processed.run(
                list(p_leaves) + s.others + s.batch, perturb, reads=reads
            )
            tag_inputs = tuple(t[0] for t in ev.tags)
            primals = tuple((ev.read(r.inputs), ev.read(r.outputs)) for r in layers)
            return tag_inputs, (processed.losses(ev, coefs), primals)

        zero = VarMap.zeros(points([r.outputs for r in layers]))
        _, vjp, (losses, primals) = jax.vjp(forward, s.params, zero, has_aux=True)

        def vjp_fn(loss_tangents):
            loss_tangents = tuple(loss_tangents)
            if len(loss_tangents) != processed.num_tags:
                raise ValueError(
                    "`vjp_fn(loss_tangents)`: expected one tangent per registered loss "
                    f"({processed.num_tags}), got {len(loss_tangents)}."
                )
            p_ct, point_ct = vjp(loss_tangents)
            out = []
            for r, (x, y) in zip(layers, primals):
                out.append(
                    LayerData(
                        inputs=x,
                        outputs=y,
                        params=tuple(
                            processed.take(s.params, i) for i in r.param_indices
                        ),
                        outputs_tangent=point_ct[r.outputs],
                        params_tangent=tuple(
                            processed.take(p_ct, i) for i in r.param_indices
                        ),
                    )
                )
            return tuple(out)

        return losses, vjp_fn


def layer_vjp(loss_fn: Callable) -> Callable:
    """Transforms `loss_fn` into `(model, batch) -> (losses, vjp_fn)`.

    `losses` is a tuple of `RegisteredLoss` (family, inputs, targets, mask), one per
    registered loss. `vjp_fn(loss_tangents)`, with one tangent per loss shaped like
    its inputs, returns one `LayerData` per layer (in `find_layers` order): primal
    inputs, outputs and parameters, and the cotangents of outputs and parameters.

    !!! Example

        Pulling back the loss's gradient in its inputs (the logits) gives the
        gradient, layer by layer:

        ```python
        losses, vjp_fn = ef.layer_vjp(loss_fn)(model, batch)
        logits = losses[0].inputs  # (32, 3)
        dlogits = (jax.nn.softmax(logits) - jax.nn.one_hot(y, 3)) / 32
        first, second = vjp_fn((dlogits,))
        assert jnp.allclose(first.params_tangent[0], grads.layers[0].weight, atol=1e-6)
        assert jnp.allclose(second.params_tangent[1], grads.layers[1].bias, atol=1e-6)
        ```
    """
    return _LayerVjp(StagedLoss(loss_fn, "eqfisher.layer_vjp"))
