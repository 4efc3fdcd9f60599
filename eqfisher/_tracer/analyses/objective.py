"""How the value `loss_fn` returns depends on its registered losses, structurally.

Every program variable gets a `Label`: the parameters it depends on other than
through a registered loss's value, and whether it depends on those values not at
all, affinely or otherwise. The returned value must be affine in the loss values
(constant factors, weighted sums, weights from the batch) and depend on parameters
only through them; the coefficient of each loss is then a derivative, computed at
run time (`LossProgram.coefficients`). Everything here runs at trace time.
"""

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from ... import _compat
from ..._stop_hessian import hessian_stopped_p
from ...losses import loss_tag_p, loss_value_tag_p
from ..program import Const, Program


NONE, AFFINE, OTHER = 0, 1, 2

# Affine in all operands jointly.
_LINEAR = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "reduce_sum",
        "convert_element_type",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "copy",
        "copy_p",
        "slice",
        "concatenate",
        "stack",  # `jnp.stack`, a primitive from jax 0.10 on
        "pad",
        "cumsum",
        "reduce_precision",
        "psum",
    }
)
# Linear in each operand when the others are fixed.
_BILINEAR = frozenset({"mul", "dot_general"})
# Linear in the listed operands; the others (divisors, indices, predicates) must not
# depend on the loss values.
_LINEAR_IN = {
    "div": (0,),
    "dynamic_slice": (0,),
    "gather": (0,),
    "dynamic_update_slice": (0, 1),
}


@dataclasses.dataclass(frozen=True)
class Label:
    params: frozenset[int] = frozenset()
    values: int = NONE


_CONST = Label()


def _values(eqn, labels: Sequence[Label]) -> int:
    vs = [lab.values for lab in labels]
    if max(vs, default=NONE) == NONE:
        return NONE
    if OTHER in vs:
        return OTHER
    name = eqn.primitive.name
    moving = [i for i, v in enumerate(vs) if v != NONE]
    if name in _LINEAR:
        return AFFINE
    if name in _BILINEAR:
        return AFFINE if len(moving) == 1 else OTHER
    if name == "select_n":
        return AFFINE if 0 not in moving else OTHER
    if name in _LINEAR_IN:
        return AFFINE if set(moving) <= set(_LINEAR_IN[name]) else OTHER
    return OTHER


def _eqn_labels(eqn, labels: list[Label]) -> list[Label]:
    prim = eqn.primitive
    if prim is loss_value_tag_p:
        return [Label(values=AFFINE)]
    if prim.name == "stop_gradient":
        return [_CONST] * len(eqn.outvars)
    if prim is hessian_stopped_p:
        # `stop_hessian` drops every second derivative through its function: what
        # comes out adds no curvature if it enters the returned value affinely, so
        # it is tracked like a loss value.
        moving = labels[0].params or labels[0].values != NONE
        return [Label(values=AFFINE if moving else NONE)]
    body = _compat.call_body(eqn)
    if body is not None and len(body[0].invars) == len(labels):
        outs = propagate(body[0], labels)
    else:
        params = frozenset().union(*(lab.params for lab in labels))
        outs = [Label(params, _values(eqn, labels))] * len(eqn.outvars)
    # Integer and boolean results carry no derivative.
    return [
        lab if jnp.issubdtype(v.aval.dtype, jnp.inexact) else _CONST
        for lab, v in zip(outs, eqn.outvars)
    ]


def propagate(jaxpr, in_labels: Sequence[Label]) -> list[Label]:
    """The labels of a jaxpr's outputs given those of its inputs."""
    env = {id(v): lab for v, lab in zip(jaxpr.invars, in_labels)}

    def read(v) -> Label:
        return _CONST if _compat.is_literal(v) else env.get(id(v), _CONST)

    for eqn in jaxpr.eqns:
        for v, lab in zip(eqn.outvars, _eqn_labels(eqn, [read(v) for v in eqn.invars])):
            env[id(v)] = lab
    return [read(v) for v in jaxpr.outvars]


def _labelled(program: Program, num_params: int):
    """`read(var) -> Label` over the whole program."""
    env = {
        id(v): Label(frozenset({i})) for i, v in enumerate(program.invars[:num_params])
    }

    def read(a) -> Label:
        return _CONST if isinstance(a, Const) else env.get(id(a), _CONST)

    for node in program.nodes:
        labels = [read(a) for a in node.operands]
        for v, lab in zip(node.outs, _eqn_labels(node.eqn, labels)):
            if v is not None:
                env[id(v)] = lab
    return read


def check_objective(
    program: Program,
    num_params: int,
    paths: Sequence[str],
    output: int,
    *,
    outside_terms: bool,
    caller: str,
) -> None:
    """Raises `ValueError` when the returned value is not affine in the registered
    losses' values, or (unless `outside_terms`) depends on parameters other than
    through them."""
    read = _labelled(program, num_params)
    label = read(program.outvars[output])
    _check_tag_operands(program, read, paths, caller)
    if label.values == OTHER:
        raise ValueError(
            f"`{caller}`: the value `loss_fn` returns depends nonlinearly on its "
            "registered losses or `eqfisher.stop_hessian` terms (e.g. log(loss), "
            "loss**2, or a loss times another): "
            "its curvature is not a weighted sum of theirs. Return a constant- or "
            "batch-weighted sum of registered losses (eqfisher.softmax_cross_entropy"
            ", ...); apply other transformations outside `loss_fn`."
        )
    if label.params and not outside_terms:
        names = ", ".join(
            paths[i].lstrip(".") or "(root)" for i in sorted(label.params)
        )
        hidden = control_flow_registrations(program)
        raise ValueError(
            f"`{caller}`: the value `loss_fn` returns depends on parameters other "
            f"than through its registered losses (a penalty or regulariser on "
            f"{names}); eqfisher's curvature covers the registered losses only. "
            "Compute that term outside `loss_fn` (for ½λ‖θ‖² add λ to the damping: "
            "`curv.solve(g, damping + λ)`), or wrap it in `eqfisher.stop_hessian` to "
            "keep its gradient and drop its curvature."
            + (f" {inside_control_flow(hidden)}" if hidden else "")
        )


def control_flow_registrations(program: Program) -> list[str]:
    """The control-flow primitives left in `program` (`cond`, `while`, ...) whose
    branches or bodies register a loss: eqfisher does not see a registration
    there as one."""
    return sorted(
        {n.eqn.primitive.name for n in program.nodes if _registers_inside(n.eqn)}
    )


def inside_control_flow(primitives: Sequence[str]) -> str:
    """What to say of losses registered inside `primitives`."""
    return (
        f"`loss_fn` registers a loss inside `{'`, `'.join(primitives)}` (`lax.cond`, "
        "`lax.switch`, `lax.while_loop`), where eqfisher does not see it as one: "
        "register the losses outside control flow and let the condition weight "
        "them, e.g. `w = jnp.where(flag, 1.0, 0.0)` and `w * loss_a + (1 - w) * "
        "loss_b` (weights may depend on the batch, not on the parameters)."
    )


def _registers_inside(eqn) -> bool:
    return any(
        e.primitive is loss_tag_p or _registers_inside(e)
        for value in eqn.params.values()
        for j in _compat.sub_jaxprs(value)
        for e in j.eqns
    )


def _check_tag_operands(program: Program, read, paths: Sequence[str], caller: str):
    """Raises `ValueError` when a registered loss's targets or mask depend on the
    parameters: the curvature takes them as data, so the value's curvature would
    differ from what eqfisher computes (a self-distillation target computed from
    the model's outputs, say)."""
    for node in program.nodes:
        if node.eqn.primitive is not loss_tag_p:
            continue
        for name, operand in zip(("targets", "mask"), node.operands[1:]):
            params: frozenset[int] = read(operand).params
            if not params:
                continue
            names = ", ".join(paths[i].lstrip(".") or "(root)" for i in sorted(params))
            raise ValueError(
                f"`{caller}`: a registered loss's {name} depend on parameters "
                f"({names}); eqfisher's curvature takes targets and masks as data, "
                "so it would not be the curvature of the value `loss_fn` returns. "
                f"Hold them constant with `jax.lax.stop_gradient(...)` (a "
                "self-distillation target, say), or compute them outside "
                "`loss_fn`."
            )
