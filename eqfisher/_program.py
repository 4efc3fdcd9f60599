"""A jaxpr flattened into one list of equations, and its interpreter.

Nested `jit`, `jax.checkpoint` and custom-derivative calls that carry parameters or
a loss tag are inlined, so that layers inside them are visible and can be perturbed.
A `scan` that reads parameters (stacked layers as `xs`, or shared weights as
consts) is unrolled, up to `MAX_UNROLL` steps: each step's slice of a stacked leaf
becomes a *unit*, a parameter of its own, so the layers of every step are found.
Every other equation (`relu`'s custom JVP, `cond`, longer scans, ...) stays one
opaque node evaluated as a whole, so its own derivative rules are kept.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from .losses import loss_tag_p


# Primitives that only move or retype data: a parameter seen through them is still
# the parameter ("a view"), and an axis can be followed through them.
STRUCTURAL = frozenset(
    {
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "squeeze",
        "expand_dims",
    }
)


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
    """A value known at trace time (a closed-over constant or a literal)."""

    value: Any


class PVar:
    """A variable of the flattened program (compared by identity).

    Inlining the same nested jaxpr twice (a jitted layer called for two layers)
    must give two sets of variables, so the program never reuses jaxpr `Var`s.
    """

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval

    def __repr__(self) -> str:
        return f"PVar({self.aval.str_short()})"


Atom = PVar | Const


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One equation of the flattened program.

    `args` are the atoms bound to the equation's distinct non-literal invars (in
    `_compat.unique_invars` order); `outs` the program variables of its outputs
    (None for dropped outputs).
    """

    eqn: Any
    args: tuple[Atom, ...]
    outs: tuple[PVar | None, ...]
    fn: Callable[..., Sequence[Any]]

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict:
        return self.eqn.params

    def operand(self, i: int) -> Atom:
        """The atom of the equation's i-th operand (literals become `Const`)."""
        v = self.eqn.invars[i]
        if _compat.is_literal(v):
            return Const(_compat.literal_value(v))
        ids = [id(u) for u in _compat.unique_invars(self.eqn)]
        return self.args[ids.index(id(v))]

    @property
    def operands(self) -> tuple[Atom, ...]:
        return tuple(self.operand(i) for i in range(len(self.eqn.invars)))


# Scans longer than this stay opaque: unrolling them would make the program (and
# its compile time) grow with the number of steps.
MAX_UNROLL = 128


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """A slice `leaf[index]` of a stacked parameter leaf, read by one scan step.

    `var` is the program variable holding it, `nodes` the equations that cut it from
    its `parent` unit (the leaf itself, or a coarser slice for nested scans).
    """

    var: PVar
    leaf: int
    index: tuple[int, ...]
    parent: PVar
    nodes: tuple[Node, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A flattened jaxpr: inputs, nodes in evaluation order, outputs, and the
    per-step slices of stacked parameters (`units`)."""

    invars: tuple[PVar, ...]
    nodes: tuple[Node, ...]
    outvars: tuple[Atom, ...]
    units: tuple[Unit, ...] = ()

    def stacked(self) -> set[int]:
        """Ids of the variables (leaves or coarser units) cut into scan units."""
        return {id(u.parent) for u in self.units}

    def consumers(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for node in self.nodes:
            for a in {id(a): a for a in node.args}:
                out.setdefault(a, []).append(node)
        return out

    def producers(self) -> dict[int, Node]:
        return {id(v): n for n in self.nodes for v in n.outs if v is not None}


def _contains_loss_tag(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is loss_tag_p:
            return True
        body = _compat.call_body(eqn)
        if body is not None and _contains_loss_tag(body[0]):
            return True
    return False


def _scan_reads(eqn, args, param_like: set[int]) -> bool:
    return (
        eqn.primitive.name == "scan"
        and 0 < eqn.params["length"] <= MAX_UNROLL
        and any(id(a) in param_like for a in args)
        and _compat.call_body_of(eqn.params["jaxpr"]) is not None
    )


def flatten(jaxpr, consts: Sequence[Any], num_params: int) -> Program:
    """Inlines the call equations that carry parameters or loss tags, and unrolls
    the scans that read parameters.

    The first `num_params` invars of `jaxpr` are the parameters.
    """
    nodes: list[Node] = []
    units: list[Unit] = []
    invars = tuple(PVar(v.aval) for v in jaxpr.invars)
    # Parameters and views of them; a call fed by one is inlined.
    param_like: set[int] = {id(v) for v in invars[:num_params]}
    # Parameter leaves and units: variable -> (leaf, index).
    origin: dict[int, tuple[int, tuple[int, ...]]] = {
        id(v): (i, ()) for i, v in enumerate(invars[:num_params])
    }
    seen: set[tuple[int, tuple[int, ...]]] = set()  # the (leaf, index) of every unit

    def walk(jaxpr, scope: dict[int, Atom]) -> list[Atom]:
        def atom(v) -> Atom:
            if _compat.is_literal(v):
                return Const(_compat.literal_value(v))
            return scope[id(v)]

        for eqn in jaxpr.eqns:
            args = tuple(atom(v) for v in _compat.unique_invars(eqn))
            body = _compat.call_body(eqn)
            if body is not None and (
                any(id(a) in param_like for a in args) or _contains_loss_tag(body[0])
            ):
                results = inline(body, [atom(u) for u in eqn.invars])
            elif _scan_reads(eqn, args, param_like):
                results = unroll(eqn, [atom(u) for u in eqn.invars])
            else:
                outs = tuple(
                    None if _compat.is_drop_var(v) else PVar(v.aval)
                    for v in eqn.outvars
                )
                if eqn.primitive.name in STRUCTURAL and any(
                    id(a) in param_like for a in args
                ):
                    param_like.update(id(o) for o in outs if o is not None)
                nodes.append(Node(eqn, args, outs, _compat.eqn_evaluator(eqn)))
                results = outs
            for v, r in zip(eqn.outvars, results):
                if r is not None and not _compat.is_drop_var(v):
                    scope[id(v)] = r
        return [atom(v) for v in jaxpr.outvars]

    def inline(body, atoms: Sequence[Atom]) -> list[Atom]:
        inner, inner_consts = body
        scope = {id(v): Const(c) for v, c in zip(inner.constvars, inner_consts)}
        scope.update({id(v): a for v, a in zip(inner.invars, atoms)})
        return walk(inner, scope)

    def call(fn: Callable, atoms: Sequence[Atom]) -> list[Atom]:
        """Inlines the jaxpr of `fn` applied to `atoms`."""
        if all(isinstance(a, Const) for a in atoms):
            out = fn(*(a.value for a in atoms))
            return [Const(x) for x in (out if isinstance(out, list) else [out])]
        specs = [
            jax.ShapeDtypeStruct(np.shape(a.value), np.result_type(a.value))
            if isinstance(a, Const)
            else jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype)
            for a in atoms
        ]
        return inline(_compat.make_jaxpr(fn, *specs), atoms)

    def step_slice(a: Atom, step: int) -> Atom:
        start = len(nodes)
        (out,) = call(lambda x: jax.lax.index_in_dim(x, step, keepdims=False), [a])
        # A slice already cut by another scan is no new unit: the detector then
        # sees its stacked leaf read outside the first scan and says so.
        if (
            id(a) in origin
            and isinstance(out, PVar)
            and (origin[id(a)][0], origin[id(a)][1] + (step,)) not in seen
        ):
            leaf, index = origin[id(a)]
            seen.add((leaf, index + (step,)))
            origin[id(out)] = (leaf, index + (step,))
            units.append(Unit(out, leaf, index + (step,), a, tuple(nodes[start:])))
            param_like.add(id(out))
        elif id(a) in param_like and isinstance(out, PVar):
            param_like.add(id(out))
        return out

    def unroll(eqn, atoms: Sequence[Atom]) -> list[Atom]:
        p = eqn.params
        (n_c, n_carry), length = _compat.scan_counts(eqn), p["length"]
        consts, carry = list(atoms[:n_c]), list(atoms[n_c : n_c + n_carry])
        xs = atoms[n_c + n_carry :]
        body = _compat.call_body_of(p["jaxpr"])
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        ys_steps = {}
        for step in steps:
            x = [step_slice(a, step) for a in xs]
            results = inline(body, consts + carry + x)
            carry, ys_steps[step] = results[:n_carry], results[n_carry:]
        ys = []
        for j, v in enumerate(eqn.outvars[n_carry:]):
            if _compat.is_drop_var(v):
                ys.append(None)
                continue
            parts = [ys_steps[t][j] for t in range(length)]
            ys.extend(call(lambda *y: jnp.stack(y), parts))
        return carry + ys

    scope: dict[int, Atom] = {id(v): Const(c) for v, c in zip(jaxpr.constvars, consts)}
    scope.update({id(v): p for v, p in zip(jaxpr.invars, invars)})
    outvars = walk(jaxpr, scope)
    return Program(
        invars=invars, nodes=tuple(nodes), outvars=tuple(outvars), units=tuple(units)
    )


@jax.tree_util.register_pytree_node_class
class VarMap:
    """A PyTree mapping jaxpr variables (by identity) to values.

    Variables are static metadata and the values are the leaves, so a `VarMap` can be
    an argument of `jax.vjp`: perturbing layer outputs by a zero `VarMap` and pulling
    a cotangent back gives the cotangents of those outputs.
    """

    def __init__(self, keys: Sequence[Any], values: Sequence[Any]):
        self.keys = tuple(keys)
        self.values = tuple(values)

    def __getitem__(self, var) -> Any:
        for k, v in zip(self.keys, self.values):
            if k is var:
                return v
        raise KeyError(var)

    def as_dict(self) -> dict[int, Any]:
        return {id(k): v for k, v in zip(self.keys, self.values)}

    def tree_flatten(self):
        return self.values, tuple(self.keys)

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(keys, values)

    @classmethod
    def zeros(cls, variables: Sequence[Any]) -> "VarMap":
        return cls(
            variables, [jnp.zeros(v.aval.shape, v.aval.dtype) for v in variables]
        )


@dataclasses.dataclass
class Evaluation:
    """What one pass of the interpreter saw."""

    env: dict[int, Any]
    tags: list[tuple[Any, Any, Any]]  # (inputs, targets, mask) of each loss tag
    outputs: tuple[Any, ...]

    def read(self, a: Atom) -> Any:
        return a.value if isinstance(a, Const) else self.env[id(a)]


def evaluate(
    program: Program,
    inputs: Sequence[Any],
    perturbations: VarMap | None = None,
    *,
    stop_after_tags: int | None = None,
) -> Evaluation:
    """Runs the program, adding `perturbations` to the variables they name.

    With `stop_after_tags=k`, stops right after the k-th loss tag (the rest of the
    program only turns tag outputs into the loss value).
    """
    env: dict[int, Any] = {id(v): x for v, x in zip(program.invars, inputs)}
    extra = perturbations.as_dict() if perturbations is not None else {}
    for k in set(env) & set(extra):
        env[k] = env[k] + extra[k]
    ev = Evaluation(env, [], ())
    for node in program.nodes:
        args = [ev.read(a) for a in node.args]
        if node.eqn.primitive is loss_tag_p:
            values = [ev.read(node.operand(i)) for i in range(3)]
            ev.tags.append(tuple(values))
            outs = [values[0]]  # the tag is the identity on its inputs
        else:
            outs = node.fn(*args)
        for v, x in zip(node.outs, outs):
            if v is None:
                continue
            env[id(v)] = x + extra[id(v)] if id(v) in extra else x
        if stop_after_tags is not None and len(ev.tags) == stop_after_tags:
            return ev
    ev.outputs = tuple(ev.read(a) for a in program.outvars)
    return ev
