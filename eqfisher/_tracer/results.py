"""The values the tracer's public functions return: `RegisteredLoss` (one
registered loss seen during a pass), `LayerData` (one layer's primals and
cotangents, from `layer_vjp`) and `LayerReport` (what `find_layers` found)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._precision import at_least_float32
from ..losses import AbstractLossFamily
from .layers import LayerInfo


class RegisteredLoss(eqx.Module):
    """One registered loss as seen during a pass: its family, its operands, and its
    coefficient in the value `loss_fn` returns.

    `coefficient` is the derivative of the returned value with respect to this
    loss's value: a scalar, or one per lane when the registration was `jax.vmap`ped
    (the lanes are the leading axes of `inputs`).

    !!! Example

        ```python
        losses, _ = ef.loss_tags_vjp(loss_fn)(model, batch)
        (loss,) = losses  # loss_fn registers one loss
        assert loss.inputs.shape == (32, 3) and loss.targets.shape == (32,)
        assert jnp.allclose(loss.weights(), 1 / 32)  # a mean over 32 examples
        assert jnp.allclose(loss.value(), loss_fn(model, batch))
        ```
    """

    family: AbstractLossFamily = eqx.field(static=True)
    inputs: Float[Array, "*leading out"]
    targets: Array
    mask: Float[Array, "*leading"]
    coefficient: Float[Array, "*lanes"]

    def weights(self) -> Float[Array, "*leading"]:
        r"""Each example's weight in the returned value:
        $\text{coefficient} \cdot \text{mask} / \sum \text{mask}$
        ($\text{coefficient} / N$ without a mask), the sum over each lane."""
        lanes = self.coefficient.ndim
        rest = self.mask.ndim - lanes
        axes = tuple(range(lanes, self.mask.ndim))
        # The count in float32 at least: above 65,504 it is inf in float16.
        wide = at_least_float32(self.mask.dtype)
        total = jnp.sum(self.mask, axis=axes, keepdims=True, dtype=wide)
        w = (self.mask.astype(wide) / total).astype(self.mask.dtype)
        return w * self.coefficient.reshape(self.coefficient.shape + (1,) * rest)

    def value(self) -> Float[Array, ""]:
        """The loss's value: the weighted sum of its per-example losses."""
        return jnp.sum(
            self.weights() * self.family.per_example(self.inputs, self.targets)
        )


class LayerData(eqx.Module):
    """Primal values and tangents of one layer, from `layer_vjp`.

    `outputs` is the output the tracer perturbs (the layer's result, after its bias);
    `outputs_tangent` its cotangent, `params_tangent` that of each parameter leaf.

    !!! Example

        For a dense layer, with the examples as rows:

        ```python
        losses, vjp_fn = ef.layer_vjp(loss_fn)(model, batch)
        ones = jnp.ones_like(losses[0].inputs)
        first, _ = vjp_fn((ones,))  # eqx.nn.Linear(4, 8), then Linear(8, 3)
        weight, bias = first.params
        assert first.inputs.shape == (32, 4) and first.outputs.shape == (32, 8)
        assert jnp.allclose(first.outputs, first.inputs @ weight.T + bias, atol=1e-6)
        dweight, dbias = first.params_tangent
        assert jnp.allclose(dweight, first.outputs_tangent.T @ first.inputs, atol=1e-5)
        assert jnp.allclose(dbias, first.outputs_tangent.sum(axis=0), atol=1e-5)
        ```
    """

    inputs: Array
    outputs: Array
    params: tuple[Array, ...]
    outputs_tangent: Array
    params_tangent: tuple[Array, ...]


class LayerReport(eqx.Module):
    """What `find_layers` found: layers, and the parameter leaves in no layer.

    **Fields:**

    - `layers`: a `LayerInfo` per layer, in model order.
    - `unmatched`: the paths of parameter leaves in no layer (they get diagonal
      blocks), and `reasons`: why, one phrase each.

    !!! Example

        ```python
        report = ef.find_layers(loss_fn, model, batch)
        assert [layer.name for layer in report.layers] == ["layers[0]", "layers[1]"]
        assert report.unmatched == ()  # every parameter is in a layer
        print(report)  # a table: layer, kind, parameters
        ```
    """

    layers: tuple[LayerInfo, ...] = eqx.field(static=True)
    unmatched: tuple[str, ...] = eqx.field(static=True)
    reasons: tuple[str, ...] = eqx.field(static=True)

    def __str__(self) -> str:
        rows = [("layer", "kind", "parameters")]
        rows += [
            (
                li.name,
                li.kind + (f" x{li.uses}" if li.uses > 1 else ""),
                ", ".join(li.param_paths),
            )
            for li in self.layers
        ]
        rows += [
            ("(unmatched)", "diagonal", f"{p}  — {r}")
            for p, r in zip(self.unmatched, self.reasons)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        return "\n".join(lines)
