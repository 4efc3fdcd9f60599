"""Capturing a loss function: `split` a model and batch into flat leaves,
`stage_loss` (trace `loss_fn` on them) into a `LossProgram` (program, loss tags,
layer records), and `StagedLoss`, a loss function with a cache of its
`LossProgram`s."""

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .. import _compat
from .._config import current_config
from .._refusal import refused_where
from ..losses import AbstractLossFamily, loss_tag_p, loss_value_tag_p
from .analyses import (
    check_objective,
    control_flow_registrations,
    inside_control_flow,
)
from .layers import Detection, LayerRecord, detect, sources, unit_paths
from .program import Evaluation, Program, PVar, VarMap, evaluate, flatten
from .results import LayerReport, RegisteredLoss


_REGISTRATION = (
    "eqfisher.softmax_cross_entropy, eqfisher.sigmoid_cross_entropy, "
    "eqfisher.squared_error or eqfisher.register_loss"
)


@dataclasses.dataclass(frozen=True, eq=False)
class LossProgram:
    """A loss function staged out: its program, loss tags and layers. Immutable.

    Parameters are numbered: the leaves `0 .. num_params - 1`, then the scan units
    (one step's slice of a stacked leaf, see `program.Unit`). `units[i]` is the
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

    @property
    def calls_custom_vjp(self) -> bool:
        """Whether a `jax.custom_vjp` call is left in the program (one holding no
        layer is not inlined), or inside a call's body: forward mode has no rule
        for it."""
        return _calls_custom_vjp([n.eqn for n in self.program.nodes])

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

    def unit_shape(self, leaves: Sequence[Any], i: int) -> tuple[tuple[int, ...], Any]:
        """`(shape, dtype)` of parameter `i` of a list of leaves, without taking
        it (no slice in the traced program)."""
        leaf, index = self.units[i]
        x = leaves[leaf]
        return tuple(x.shape[len(index) :]), x.dtype

    def run(
        self,
        inputs,
        perturbations: VarMap | None = None,
        *,
        whole_program: bool = False,
        reads: Sequence[Any] = (),
        read_means: Mapping[int, tuple[int, ...]] | None = None,
    ) -> Evaluation:
        """Runs the program: to its end with `whole_program`, else only up to the
        last loss tag. `reads` are the scan-body variables (`StepVar`s) the caller
        reads from the result, `read_means` what a scan averages them over (see
        `evaluate`)."""
        return evaluate(
            self.program,
            inputs,
            perturbations,
            stop_after_tags=None if whole_program else self.num_tags,
            reads=reads,
            read_means=read_means,
        )

    def coefficients(self, inputs: Sequence[Any]) -> tuple[Array, ...]:
        """The derivative of the objective with respect to each registered loss's
        value (the objective is affine in them: `check_objective`).

        Held constant in the parameters (a coefficient does not depend on them, and
        a derivative through this pass would differentiate the whole program twice),
        not in the batch: a coefficient the batch gives is differentiable."""
        n = self.num_params
        inputs = list(jax.lax.stop_gradient(list(inputs[:n]))) + list(inputs[n:])
        used = [v for v in self.value_vars if v is not None]

        def objective(perturb):
            return self.run(inputs, perturb, whole_program=True).outputs[self.objective]

        out, vjp = jax.vjp(objective, VarMap.zeros(used))
        # The pull-back from a concrete cotangent: a coefficient that is a
        # constant of the program (`mean`'s 1/N) comes out concrete, checked
        # here, and a batch's weight traced, checked at run time.
        # (Traced inside `jax.shard_map`: jax 0.12 cannot run it eagerly under a
        # `Manual` mesh built from `Explicit` axes.)
        eager = (
            contextlib.nullcontext
            if _compat.in_manual_mesh()
            else (jax.ensure_compile_time_eval)
        )
        with eager():
            (ct,) = vjp(jnp.ones(jnp.shape(out), out.dtype))
        by_var = ct.as_dict()
        message = (
            f"`{self.caller}`: a registered loss enters the value `loss_fn` "
            "returns with a negative coefficient: its GGN or Fisher would be "
            "negative semidefinite, and eqfisher's curvature is positive "
            "semidefinite. Return losses with nonnegative weights (maximising a "
            "likelihood is minimising a registered negative log-likelihood)."
        )
        coefs = []
        for v in self.value_vars:
            c = by_var[id(v)] if v is not None else jnp.zeros((), out.dtype)
            concrete = not isinstance(c, jax.core.Tracer)
            bad = np.asarray(np.asarray(c) < 0) if concrete else c < 0
            coefs.append(refused_where(c, bad, message))
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


def calls_custom_vjp(fn: Callable, *args: Any) -> bool:
    """Whether `fn(*args)` calls a `jax.custom_vjp` function (which has no
    forward-mode rule), found in its jaxpr without running it."""
    return _calls_custom_vjp(jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def _calls_custom_vjp(eqns) -> bool:
    return any(n.startswith("custom_vjp") for n in _primitive_names(eqns))


def _primitive_names(eqns) -> set[str]:
    """The names of the primitives of `eqns` and of their sub-jaxprs."""
    return {eqn.primitive.name for eqn in _all_eqns(eqns)}


def _all_eqns(eqns):
    """`eqns` and the equations of their sub-jaxprs, depth first."""
    for eqn in eqns:
        yield eqn
        for value in eqn.params.values():
            for j in _compat.sub_jaxprs(value):
                yield from _all_eqns(j.eqns)


def _refuse_collectives(eqns, caller: str) -> None:
    """Refuses a `loss_fn` that communicates over the devices of an enclosing
    `jax.shard_map` (`lax.pmean` of the loss): each device's curvature would then
    hold the others' examples' derivatives, which eqfisher cannot separate. (A
    collective over a `vmap`'s named axis, as BatchNorm's, is an ordinary sum by
    the time it is traced: its axes are positions.)"""
    manual = _compat.manual_axes()
    if not manual:  # (outside `shard_map`, no walk of the program)
        return
    found = sorted(
        {
            eqn.primitive.name
            for eqn in _all_eqns(eqns)
            for key in ("axes", "axis_name")
            if manual & set(_names(eqn.params.get(key)))
        }
    )
    if found:
        raise ValueError(
            f"`{caller}`: `loss_fn` calls collectives over the devices of "
            f"`jax.shard_map` ({', '.join(found)}), such as `jax.lax.pmean` of the "
            "loss. Return each device's own loss from `loss_fn` and average the "
            "results instead: `jax.lax.pmean` of the curvature (or of the loss, "
            "gradient and curvature) after the eqfisher call (docs/scale.md)."
        )


def _names(axes) -> tuple:
    """A collective's `axes`/`axis_name` parameter as a tuple."""
    return axes if isinstance(axes, tuple) else (axes,)


def _registrations(program: Program, loss_fn: Callable, caller: str):
    """The program's loss tags and the variables of their values, after checking
    that there are some, one value each."""
    tags = [n for n in program.nodes if n.eqn.primitive is loss_tag_p]
    if not tags:
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        hidden = control_flow_registrations(program)
        if hidden:
            raise ValueError(f"`{caller}`: {inside_control_flow(hidden)}")
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
    return tags, values


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


def _check_returns(
    out: Any, returns: Returns, caller: str, takes_has_aux: bool
) -> None:
    """Checks what `loss_fn` returned, as `eqx.filter_value_and_grad` does;
    `takes_has_aux` says whether `caller` takes `has_aux=` (the fix it names for a
    `(loss, aux)` pair)."""
    is_pair = isinstance(out, (tuple, list)) and len(out) == 2
    if returns == "loss" and isinstance(out, (tuple, list)):
        fix = (
            "pass `has_aux=True` (`has_aux`); for `(loss, gradient_surrogate)`, "
            "`surrogate=True`"
            if takes_has_aux
            else "return only the loss (e.g. `lambda m, b: loss_fn(m, b)[0]`) "
            "(`has_aux`)"
        )
        raise TypeError(
            f"`{caller}`: `loss_fn` returned a {type(out).__name__} of "
            f"{len(out)} items, expected a scalar loss; for `(loss, aux)` {fix}."
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


_FILTERED_MODEL = (
    "(`{caller}`: `loss_fn` called a None from the model. If `model` is a filtered "
    "model, e.g. `eqx.filter(model, eqx.is_inexact_array)` or the params of "
    "`eqx.partition`, pass the whole model: eqfisher takes the parameters from "
    "it itself.)"
)


_SWAPPED = (
    "(`{caller}`: `loss_fn` is a {kind} holding floating-point arrays, and `model` "
    "holds none: are they swapped? The arguments are `(loss_fn, model, batch)`, "
    "`loss_fn` first.)"
)


def stage_loss(
    loss_fn: Callable,
    s: Split,
    *,
    caller: str = "eqfisher",
    returns: Returns = "loss",
    layers: bool = True,
    takes_has_aux: bool = False,
) -> LossProgram:
    """Traces `loss_fn` on the split model and batch into a `LossProgram`.

    `returns` says what `loss_fn` returns: the scalar loss, `(loss, aux)` or
    `(loss, surrogate)`; `takes_has_aux` whether `caller` takes `has_aux=` (the
    fix named for a pair returned without it). The loss must be affine in the
    registered losses' values and (except with a surrogate) depend on parameters
    only through them. Without `layers`, no layers are looked for (a program that
    is only run, such as the per-example pass's: a scanned model's detection costs
    a record per step).
    """
    refuse_complex(caller, jax.tree_util.tree_unflatten(s.params_def, s.params))
    n_p, n_o = len(s.params), len(s.others)
    out_trees = []

    def flat_fn(*leaves):
        model, batch = s.rebuild(
            list(leaves[:n_p]), list(leaves[n_p : n_p + n_o]), list(leaves[n_p + n_o :])
        )
        try:
            out = loss_fn(model, batch)
        except TypeError as e:
            if "'NoneType' object is not callable" in str(e):
                e.add_note(_FILTERED_MODEL.format(caller=caller))
            if not n_p and any(map(eqx.is_inexact_array, jax.tree.leaves(loss_fn))):
                e.add_note(_SWAPPED.format(caller=caller, kind=type(loss_fn).__name__))
            raise
        _check_returns(out, returns, caller, takes_has_aux)
        if returns == "aux":  # the aux's other leaves are static, as for Equinox
            out = (out[0], eqx.filter(out[1], eqx.is_array))
        out_trees.append(jax.tree_util.tree_structure(out))
        return out

    jaxpr, consts = _compat.make_jaxpr(flat_fn, *s.inputs)
    _refuse_collectives(jaxpr.eqns, caller)
    program = flatten(jaxpr, consts, n_p)
    tags, values = _registrations(program, loss_fn, caller)
    params = jax.tree_util.tree_unflatten(s.params_def, s.params)
    paths = tuple(
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    check_objective(
        program, n_p, paths, 0, outside_terms=returns == "surrogate", caller=caller
    )
    found = detect(program, paths) if layers else Detection((), ())
    return LossProgram(
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


class StagedLoss:
    """A loss function with a cache of its `LossProgram`s, one per structure.

    `caller` names the public function in error messages, `returns` is what
    `loss_fn` returns and `takes_has_aux` whether `caller` takes `has_aux=` (see
    `stage_loss`).
    """

    def __init__(
        self,
        loss_fn: Callable,
        caller: str,
        returns: Returns = "loss",
        *,
        takes_has_aux: bool = False,
    ):
        if not callable(loss_fn):
            raise TypeError(f"`{caller}`: `loss_fn` must be callable, got {loss_fn!r}.")
        self.loss_fn = loss_fn
        self.cache = {}
        self.caller = caller
        self.returns: Returns = returns
        self.takes_has_aux = takes_has_aux

    def stage(self, s: Split, *, layers: bool = True) -> LossProgram:
        refuse_shard_map(self.caller, s.inputs)
        refuse_explicit_axes(self.caller, s.inputs)
        refuse_uncanonical(self.caller, s.inputs)
        key = (s.key, current_config(), layers)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        processed = stage_loss(
            self.loss_fn,
            s,
            caller=self.caller,
            returns=self.returns,
            layers=layers,
            takes_has_aux=self.takes_has_aux,
        )
        consts = [
            n for n in processed.program.nodes for a in n.args if _is_tracer_const(a)
        ]
        if not consts:
            self.cache[key] = processed
        return processed


def refuse_shard_map(caller: str, leaves: Sequence[Any]) -> None:
    """Refuses arrays typed as varying over a `jax.shard_map` mesh axis (its
    default `check_vma=True`): there JAX sums the derivatives in replicated
    parameters over the devices, which mixed the examples of every device into each
    per-example gradient (a `Dense()` GGN 7× off, with no error)."""
    if any(map(_compat.is_varying, leaves)):
        raise ValueError(
            f"`{caller}`: called inside `jax.shard_map` with `check_vma=True` (its "
            "default), where JAX sums the derivatives in replicated parameters "
            "over the devices, which would mix the devices' examples. Pass "
            "`check_vma=False` to `jax.shard_map` (each device then computes its "
            "own share's curvature, which you average with `jax.lax.pmean`), or "
            "shard the batch with `jax.device_put` and call eqfisher under "
            "`jax.jit` (docs/scale.md)."
        )


def refuse_explicit_axes(caller: str, leaves: Sequence[Any]) -> None:
    """Refuses arrays sharded over `Explicit` mesh axes (`jax.make_mesh`'s
    default), whose types carry their sharding: the curvature's own contractions
    over the examples have no output sharding there, and JAX raises inside them."""
    axes = sorted(set().union(*map(_compat.explicit_axes, leaves)))
    if axes:
        raise ValueError(
            f"`{caller}`: the model or batch is sharded over mesh axes of type "
            f"`Explicit` ({', '.join(map(repr, axes))}), the default of "
            "`jax.make_mesh`; eqfisher's curvature needs `Auto` axes, where XLA "
            "places its contractions over the examples. Build the mesh with "
            "`jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) "
            "* len(names))` (docs/scale.md), or call eqfisher inside "
            "`jax.sharding.auto_axes(f, out_sharding=P())`."
        )


def refuse_uncanonical(caller: str, leaves: Sequence[Any]) -> None:
    """Refuses floating-point arrays of a dtype JAX no longer computes in: float64
    arrays made while `jax_enable_x64` was on, used after it was turned off. JAX
    computes their derivatives in float32, which the curvature's own arrays
    would not match."""
    wide = sorted(
        {
            str(x.dtype)
            for x in leaves
            if eqx.is_inexact_array(x)
            and jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype
        }
    )
    if wide:
        raise TypeError(
            f"`{caller}`: the model or batch holds {', '.join(wide)} arrays, but "
            "`jax_enable_x64` is off (they were made while it was on). Turn it on "
            "again (`jax.config.update('jax_enable_x64', True)`) before this "
            "call, or cast the model and batch to 32-bit dtypes."
        )


def refuse_complex(caller: str, params: PyTree) -> None:
    """Refuses complex parameters: a curvature is over real coordinates, where a
    complex leaf is two (its real and imaginary parts), and a matrix over the
    complex leaves themselves is another one (neither Hermitian nor that)."""
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.complexfloating)
    ]
    if paths:
        raise TypeError(
            f"`{caller}`: the model has complex parameters (at {', '.join(paths)}); "
            "curvature is defined over real parameters, and a complex one is two "
            "real ones. Store its real and imaginary parts as two real leaves and "
            "build the complex array inside the model (`w_re + 1j * w_im`); or, "
            "to hold it fixed, close over it in `loss_fn` rather than pass it in "
            "the model."
        )


def _is_tracer_const(atom) -> bool:
    return isinstance(getattr(atom, "value", None), jax.core.Tracer)
