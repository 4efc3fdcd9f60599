"""The tracing core: capture a loss function, find its layers, and differentiate it.

`loss_fn(model, batch)` is traced once per (model structure, batch shapes and dtypes)
into a `ProcessedTrace`: the flattened jaxpr, its loss tags, and its layer records,
with the parameters known by their model paths. Everything here runs inside
`jax.jit`/`eqx.filter_jit`; the trace is Python work done at JAX trace time only.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from . import _compat, _objective
from ._config import current_config
from ._layers import Detection, LayerInfo, LayerRecord, detect, sources, unit_paths
from ._program import (
    Evaluation,
    Program,
    PVar,
    VarMap,
    evaluate,
    flatten,
    points,
)
from .losses import AbstractLossFamily, loss_tag_p, loss_value_tag_p


_REGISTRATION = (
    "eqfisher.softmax_cross_entropy, eqfisher.sigmoid_cross_entropy, "
    "eqfisher.squared_error or eqfisher.register_loss"
)


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
        w = self.mask / jnp.sum(self.mask, axis=axes, keepdims=True)
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


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedTrace:
    """A traced loss function: program, loss tags and layers. Immutable.

    Parameters are numbered: the leaves `0 .. num_params - 1`, then the scan units
    (one step's slice of a stacked leaf, see `_program.Unit`). `units[i]` is the
    `(leaf, index)` of parameter `i` (`index == ()` for a whole leaf), `paths[i]`
    its path; `LayerRecord.param_indices` use these numbers.
    """

    program: Program
    num_params: int
    param_paths: tuple[str, ...]
    layers: tuple[LayerRecord, ...]
    unmatched: tuple[tuple[str, str], ...]
    families: tuple[AbstractLossFamily, ...]
    units: tuple[tuple[int, tuple[int, ...]], ...]
    paths: tuple[str, ...]
    # The variable holding each registered loss's value (None if unused), and the
    # program output that is the objective.
    value_vars: tuple[PVar | None, ...] = ()
    objective: int = 0
    out_tree: Any = None
    caller: str = "eqfisher"

    @property
    def num_tags(self) -> int:
        return len(self.families)

    def parts(self, leaves: Sequence[int]) -> list[int]:
        """The parameters that partition the given leaves: each leaf itself, or the
        finest units of a stacked leaf, in order."""
        split = self.program.stacked()
        srcvars = sources(self.program, self.num_params)
        chosen = set(leaves)
        return [
            i
            for i, (leaf, _) in enumerate(self.units)
            if leaf in chosen and id(srcvars[i]) not in split
        ]

    def take(self, leaves: Sequence[Any], i: int) -> Any:
        """Parameter `i` of a list of leaves (or of leaf-shaped tangents)."""
        leaf, index = self.units[i]
        return leaves[leaf][index] if index else leaves[leaf]

    def run(
        self,
        inputs,
        perturbations: VarMap | None = None,
        *,
        full: bool = False,
        reads: Sequence[Any] = (),
    ) -> Evaluation:
        """Runs the program; `reads` are the scan-body variables (`StepVar`s) the
        caller reads from the result."""
        return evaluate(
            self.program,
            inputs,
            perturbations,
            stop_after_tags=None if full else self.num_tags,
            reads=reads,
        )

    def coefficients(self, inputs: Sequence[Any]) -> tuple[Array, ...]:
        """The derivative of the objective with respect to each registered loss's
        value (the objective is affine in them: `_objective.check`)."""
        inputs = jax.lax.stop_gradient(list(inputs))
        used = [v for v in self.value_vars if v is not None]

        def objective(perturb):
            return self.run(inputs, perturb, full=True).outputs[self.objective]

        out, vjp = jax.vjp(objective, VarMap.zeros(used))
        (ct,) = vjp(jnp.ones_like(out))
        by_var = ct.as_dict()
        coefs = []
        for v in self.value_vars:
            c = by_var[id(v)] if v is not None else jnp.zeros((), out.dtype)
            c = eqx.error_if(
                c,
                c < 0,
                f"`{self.caller}`: a registered loss enters the value `loss_fn` "
                "returns with a negative coefficient: its GGN or Fisher would be "
                "negative semidefinite, and eqfisher's curvature is positive "
                "semidefinite. Return losses with nonnegative weights (maximising a "
                "likelihood is minimising a registered negative log-likelihood).",
            )
            coefs.append(c)
        return tuple(coefs)

    def losses(
        self, ev: Evaluation, coefficients: Sequence[Array]
    ) -> tuple[RegisteredLoss, ...]:
        return tuple(
            RegisteredLoss(f, *operands, c)
            for f, operands, c in zip(self.families, ev.tags, coefficients)
        )

    def report(self) -> LayerReport:
        uses: dict[tuple[int, ...], list[LayerRecord]] = {}
        for r in self.layers:
            uses.setdefault(r.param_indices, []).append(r)
        infos = tuple(
            dataclasses.replace(rs[0].info, uses=len(rs)) if len(rs) > 1 else rs[0].info
            for rs in uses.values()
        )
        return LayerReport(
            layers=infos,
            unmatched=tuple(p for p, _ in self.unmatched),
            reasons=tuple(r for _, r in self.unmatched),
        )


@dataclasses.dataclass(frozen=True)
class Split:
    """A model and batch split into flat array leaves and what rebuilds them."""

    params: list[Any]
    others: list[Any]
    batch: list[Any]
    params_def: Any
    rebuild: Callable[[list, list, list], tuple[Any, Any]]
    key: Any

    @property
    def inputs(self) -> list[Any]:
        return self.params + self.others + self.batch


def split(model: PyTree, batch: PyTree) -> Split:
    params, rest = eqx.partition(model, eqx.is_inexact_array)
    others, static = eqx.partition(rest, eqx.is_array)
    b_dyn, b_static = eqx.partition(batch, eqx.is_array)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    o_leaves, o_def = jax.tree_util.tree_flatten(others)
    b_leaves, b_def = jax.tree_util.tree_flatten(b_dyn)

    def rebuild(p, o, b):
        m = eqx.combine(
            jax.tree_util.tree_unflatten(p_def, p),
            jax.tree_util.tree_unflatten(o_def, o),
            static,
        )
        return m, eqx.combine(jax.tree_util.tree_unflatten(b_def, b), b_static)

    avals = tuple((x.shape, x.dtype) for x in p_leaves + o_leaves + b_leaves)
    key = (p_def, o_def, b_def, _hashable(static), _hashable(b_static), avals)
    return Split(p_leaves, o_leaves, b_leaves, p_def, rebuild, key)


def _hashable(tree) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    try:
        hash((treedef, tuple(leaves)))
    except TypeError:
        return object()  # never equal: no caching for this structure
    return treedef, tuple(leaves)


Returns = Literal["loss", "aux", "surrogate"]


def _check_returns(out: Any, returns: Returns, caller: str) -> None:
    """Checks what `loss_fn` returned, as `eqx.filter_value_and_grad` does."""
    is_pair = isinstance(out, (tuple, list)) and len(out) == 2
    if returns == "loss" and isinstance(out, (tuple, list)):
        fix = (
            "pass `has_aux=True`"
            if caller.endswith("value_grad_and_curvature")
            else "return only the loss (e.g. `lambda m, b: loss_fn(m, b)[0]`)"
        )
        raise TypeError(
            f"`{caller}`: `loss_fn` returned a {type(out).__name__} of "
            f"{len(out)} items, expected a scalar loss; for `(loss, aux)` {fix} "
            "(`has_aux`)."
        )
    if returns != "loss" and not is_pair:
        flag = "has_aux=True" if returns == "aux" else "surrogate=True"
        raise TypeError(
            f"`{caller}(..., {flag})`: `loss_fn` must return a pair "
            f"`(loss, {'aux' if returns == 'aux' else 'surrogate'})`, got "
            f"{type(out).__name__}. Drop `{flag.split('=')[0]}` for a loss_fn "
            "returning only the loss."
        )
    scalars = {"loss": [out], "aux": [out[0]] if is_pair else [], "surrogate": out}
    for value in scalars[returns]:
        if not (eqx.is_array(value) and jnp.issubdtype(value.dtype, jnp.floating)):
            raise TypeError(
                f"`{caller}`: the loss `loss_fn` returns must be a floating-point "
                f"scalar array, got {value!r}."
            )
        if value.shape != ():
            raise ValueError(
                f"`{caller}`: the loss `loss_fn` returns must be a scalar, got shape "
                f"{value.shape}; reduce it (e.g. jnp.mean) inside `loss_fn`."
            )


def trace(
    loss_fn: Callable,
    s: Split,
    *,
    caller: str = "eqfisher",
    returns: Returns = "loss",
    layers: bool = True,
) -> ProcessedTrace:
    """Traces `loss_fn` on the split model and batch.

    `returns` says what `loss_fn` returns: the scalar loss, `(loss, aux)` or
    `(loss, surrogate)`. The loss must be affine in the registered losses' values
    and (except with a surrogate) depend on parameters only through them. Without
    `layers`, no layers are looked for (a trace that is only run, such as the
    per-example pass's: a scanned model's detection costs a record per step).
    """
    n_p, n_o = len(s.params), len(s.others)
    out_trees = []

    def flat_fn(*leaves):
        model, batch = s.rebuild(
            list(leaves[:n_p]), list(leaves[n_p : n_p + n_o]), list(leaves[n_p + n_o :])
        )
        out = loss_fn(model, batch)
        _check_returns(out, returns, caller)
        out_trees.append(jax.tree_util.tree_structure(out))
        return out

    jaxpr, consts = _compat.make_jaxpr(flat_fn, *s.inputs)
    program = flatten(jaxpr, consts, n_p)
    tags = [n for n in program.nodes if n.eqn.primitive is loss_tag_p]
    if not tags:
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        raise ValueError(
            f"`{caller}`: `loss_fn` ({name}) registers no loss. Compute the loss "
            f"with {_REGISTRATION}; each returns the scalar loss and marks the model "
            "outputs for curvature."
        )
    values = [n.outs[0] for n in program.nodes if n.eqn.primitive is loss_value_tag_p]
    if len(values) != len(tags):
        raise ValueError(
            f"`{caller}`: `loss_fn` has {len(tags)} loss tags but {len(values)} "
            f"registered loss values; register losses only with {_REGISTRATION}."
        )
    params = jax.tree_util.tree_unflatten(s.params_def, s.params)
    paths = tuple(
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    _objective.check(
        program, n_p, paths, 0, outside_terms=returns == "surrogate", caller=caller
    )
    found = detect(program, paths) if layers else Detection((), ())
    return ProcessedTrace(
        program=program,
        num_params=n_p,
        param_paths=paths,
        layers=found.layers,
        unmatched=found.unmatched,
        families=tuple(n.params["family"] for n in tags),
        units=tuple((i, ()) for i in range(n_p))
        + tuple((u.leaf, u.index) for u in program.units),
        paths=tuple(unit_paths(program, paths)),
        value_vars=tuple(values),
        objective=0,
        out_tree=out_trees[-1],
        caller=caller,
    )


class Traced:
    """A loss function with a cache of its traces, one per argument structure."""

    def __init__(self, loss_fn: Callable, caller: str, returns: Returns = "loss"):
        if not callable(loss_fn):
            raise TypeError(f"`{caller}`: `loss_fn` must be callable, got {loss_fn!r}.")
        self.loss_fn = loss_fn
        self.cache = {}
        self.caller = caller
        self.returns = returns

    def trace(self, s: Split, *, layers: bool = True) -> ProcessedTrace:
        key = (s.key, current_config(), layers)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        processed = trace(
            self.loss_fn, s, caller=self.caller, returns=self.returns, layers=layers
        )
        consts = [
            n for n in processed.program.nodes for a in n.args if _is_tracer_const(a)
        ]
        if not consts:
            self.cache[key] = processed
        return processed


def _is_tracer_const(atom) -> bool:
    return isinstance(getattr(atom, "value", None), jax.core.Tracer)


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
    processed = trace(loss_fn, split(model, batch), caller="eqfisher.find_layers")
    report = processed.report()
    if strict and report.unmatched:
        detail = "; ".join(f"{p} ({r})" for p, r in processed.unmatched)
        raise ValueError(
            "`eqfisher.find_layers(..., strict=True)`: parameters in no layer: "
            f"{detail}. Pass `strict=False` to give them diagonal blocks."
        )
    return report


class _LayerVjp:
    def __init__(self, traced: Traced):
        self.traced = traced

    def __call__(self, model: PyTree, batch: PyTree):
        s = split(model, batch)
        processed = self.traced.trace(s)
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
    return _LayerVjp(Traced(loss_fn, "eqfisher.layer_vjp"))


def _params_fn(processed: ProcessedTrace, s: Split):
    coefs = processed.coefficients(s.inputs)

    def fn(p_leaves):
        ev = processed.run(list(p_leaves) + s.others + s.batch)
        return tuple(t[0] for t in ev.tags), processed.losses(ev, coefs)

    return fn


def _unflatten(s: Split, leaves) -> PyTree:
    return jax.tree_util.tree_unflatten(s.params_def, list(leaves))


def loss_tags_vjp(loss_fn: Callable) -> Callable:
    """`(model, batch) -> (losses, vjp_fn)`; `vjp_fn(tangents)` gives parameter
    cotangents (a PyTree like `eqx.filter(model, eqx.is_inexact_array)`) of the
    registered losses' inputs.

    !!! Example

        The loss's gradient in the logits, pulled back, is the gradient:

        ```python
        losses, vjp_fn = ef.loss_tags_vjp(loss_fn)(model, batch)
        logits = losses[0].inputs  # (32, 3)
        dlogits = (jax.nn.softmax(logits) - jax.nn.one_hot(y, 3)) / 32
        pulled = vjp_fn((dlogits,))  # like params
        for a, b in zip(jax.tree.leaves(pulled), jax.tree.leaves(grads)):
            assert jnp.allclose(a, b, atol=1e-6)
        ```
    """
    traced = Traced(loss_fn, "eqfisher.loss_tags_vjp")

    def transformed(model, batch):
        s = split(model, batch)
        fn = _params_fn(traced.trace(s, layers=False), s)
        _, vjp, losses = jax.vjp(fn, s.params, has_aux=True)
        return losses, lambda tangents: _unflatten(s, vjp(tuple(tangents))[0])

    return transformed


def loss_tags_jvp(loss_fn: Callable) -> Callable:
    """`(model, batch, params_tangent) -> (losses, tangents of the losses' inputs)`.

    !!! Example

        The tangent of the logits, J v, against `eqx.filter_jvp`:

        ```python
        losses, (dlogits,) = ef.loss_tags_jvp(loss_fn)(model, batch, grads)
        _, expected = eqx.filter_jvp(lambda m: jax.vmap(m)(x), (model,), (grads,))
        assert dlogits.shape == (32, 3)
        assert jnp.allclose(dlogits, expected, atol=1e-6)
        ```
    """
    traced = Traced(loss_fn, "eqfisher.loss_tags_jvp")

    def transformed(model, batch, params_tangent):
        s = split(model, batch)
        fn = _params_fn(traced.trace(s, layers=False), s)
        t_leaves = jax.tree_util.tree_leaves(params_tangent)
        _, tangents, losses = jax.jvp(fn, (s.params,), (t_leaves,), has_aux=True)
        return losses, tangents

    return transformed


def loss_tags_hvp(loss_fn: Callable) -> Callable:
    """`(model, batch, params_tangent) -> (H v, losses)`, with H the Hessian of the
    registered losses' values weighted by their coefficients in the value `loss_fn`
    returns, by forward-over-reverse differentiation.

    !!! Example

        Here the value is the registered loss itself, so H is the Hessian of
        `loss_fn`:

        ```python
        hv, losses = ef.loss_tags_hvp(loss_fn)(model, batch, grads)
        grad_fn = lambda m: eqx.filter_grad(loss_fn)(m, batch)
        _, expected = eqx.filter_jvp(grad_fn, (model,), (grads,))
        for a, b in zip(jax.tree.leaves(hv), jax.tree.leaves(expected)):
            assert jnp.allclose(a, b, atol=1e-5)
        ```
    """
    traced = Traced(loss_fn, "eqfisher.loss_tags_hvp")

    def transformed(model, batch, params_tangent):
        s = split(model, batch)
        fn = _params_fn(traced.trace(s, layers=False), s)

        def total(p):
            return sum(loss.value() for loss in fn(p)[1])

        t_leaves = jax.tree_util.tree_leaves(params_tangent)
        _, hvp = jax.jvp(jax.grad(total), (s.params,), (t_leaves,))
        return _unflatten(s, hvp), fn(s.params)[1]

    return transformed
