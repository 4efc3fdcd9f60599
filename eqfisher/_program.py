"""A jaxpr flattened into one list of equations, and its interpreter.

Nested `jit`, `jax.checkpoint` and custom-derivative calls that carry parameters or
a loss tag are inlined, so that layers inside them are visible and can be perturbed.
A `scan` that reads parameters (stacked layers as `xs`, or shared weights as
consts) is unrolled, up to `Config.max_unroll` steps: each step's slice of a stacked leaf
becomes a *unit*, a parameter of its own, so the layers of every step are found.
Every other equation (`relu`'s custom JVP, `cond`, longer scans, ...) stays one
opaque node evaluated as a whole, so its own derivative rules are kept.
"""

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._config import current_config
from ._declare import layer_tag_p
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


@dataclasses.dataclass(frozen=True)
class Origin:
    """The parameter a variable holds: leaf `leaf`, sliced at `index` for a scan
    unit; with `exact=False`, a view or a slice of it."""

    leaf: int
    index: tuple[int, ...] = ()
    exact: bool = True


class PVar:
    """A variable of the flattened program (compared by identity).

    Inlining the same nested jaxpr twice (a jitted layer called for two layers)
    must give two sets of variables, so the program never reuses jaxpr `Var`s.
    `origin` says which parameter it holds, if any (a call fed by one is inlined).
    """

    __slots__ = ("aval", "origin")

    def __init__(self, aval, origin: Origin | None = None):
        self.aval = aval
        self.origin = origin

    def __repr__(self) -> str:
        return f"PVar({self.aval.str_short()})"


def _holds_param(atom: "Atom") -> bool:
    return isinstance(atom, PVar) and atom.origin is not None


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


def _contains_loss_tag(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is loss_tag_p:
            return True
        body = _compat.call_body(eqn)
        if body is not None and _contains_loss_tag(body[0]):
            return True
    return False


class _Piece(NamedTuple):
    """What flattening part of a jaxpr gives: the atoms of its outputs, its
    equations and the scan units it cut."""

    outs: list[Atom | None]  # None for a dropped output
    nodes: tuple[Node, ...] = ()
    units: tuple[Unit, ...] = ()


def _unit_keys(units: Sequence[Unit]) -> frozenset[tuple[int, tuple[int, ...]]]:
    return frozenset((u.leaf, u.index) for u in units)


def _atom(scope: Mapping[int, Atom], v) -> Atom:
    if _compat.is_literal(v):
        return Const(_compat.literal_value(v))
    return scope[id(v)]


def flatten(jaxpr, consts: Sequence[Any], num_params: int) -> Program:
    """Inlines the call equations that carry parameters or loss tags, and unrolls
    the scans that read parameters (and the declared layers with groups).

    The first `num_params` invars of `jaxpr` are the parameters.
    """
    invars = tuple(
        PVar(v.aval, Origin(i) if i < num_params else None)
        for i, v in enumerate(jaxpr.invars)
    )
    scope = {id(v): Const(c) for v, c in zip(jaxpr.constvars, consts)}
    scope.update({id(v): p for v, p in zip(jaxpr.invars, invars)})
    piece = _walk(jaxpr, scope, frozenset())
    return Program(invars, piece.nodes, tuple(piece.outs), piece.units)


def _walk(
    jaxpr,
    scope: Mapping[int, Atom],
    made: frozenset,
    out_origins: Mapping[int, Origin] = types.MappingProxyType({}),
) -> _Piece:
    """Flattens the equations of `jaxpr`, whose variables `scope` binds.

    `made` are the `(leaf, index)` of the units already cut; `out_origins` gives
    origins to some of the jaxpr's outputs (the units a slice cuts).
    """
    scope = dict(scope)
    nodes: list[Node] = []
    units: list[Unit] = []
    for eqn in jaxpr.eqns:
        atoms = [_atom(scope, v) for v in eqn.invars]
        piece = _flatten_eqn(eqn, atoms, made, out_origins)
        nodes.extend(piece.nodes)
        units.extend(piece.units)
        made = made | _unit_keys(piece.units) if piece.units else made
        for v, r in zip(eqn.outvars, piece.outs):
            if r is not None and not _compat.is_drop_var(v):
                scope[id(v)] = r
    outs = [_atom(scope, v) for v in jaxpr.outvars]
    return _Piece(outs, tuple(nodes), tuple(units))


def _flatten_eqn(eqn, atoms, made, out_origins) -> _Piece:
    args = [_atom_of(eqn, atoms, v) for v in _compat.unique_invars(eqn)]
    body = _compat.call_body(eqn)
    reads_params = any(_holds_param(a) for a in args)
    if body is not None and (reads_params or _contains_loss_tag(body[0])):
        return _inline(body, atoms, made)
    if reads_params and _unrolls(eqn):
        return _unroll(eqn, atoms, made)
    if reads_params and eqn.primitive is layer_tag_p and eqn.params["groups"]:
        return _ungroup(eqn, atoms, made)
    # A relayout of a parameter is a view of it: still a parameter.
    origin = next((a.origin for a in args if isinstance(a, PVar) and a.origin), None)
    if origin is not None and eqn.primitive.name in STRUCTURAL:
        origin = dataclasses.replace(origin, exact=False)
    else:
        origin = None
    outs = tuple(
        None if _compat.is_drop_var(v) else PVar(v.aval, out_origins.get(id(v), origin))
        for v in eqn.outvars
    )
    node = Node(eqn, tuple(args), outs, _compat.eqn_evaluator(eqn))
    return _Piece(list(outs), (node,))


def _atom_of(eqn, atoms, v) -> Atom:
    return atoms[[id(u) for u in eqn.invars].index(id(v))]


def _inline(
    body, atoms: Sequence[Atom], made, origins: Sequence[Origin | None] = ()
) -> _Piece:
    """Flattens a call's body applied to `atoms`; `origins` are given to its
    outputs."""
    inner, inner_consts = body
    scope = {id(v): Const(c) for v, c in zip(inner.constvars, inner_consts)}
    scope.update({id(v): a for v, a in zip(inner.invars, atoms)})
    out_origins = {id(v): o for v, o in zip(inner.outvars, origins) if o is not None}
    return _walk(inner, scope, made, types.MappingProxyType(out_origins))


def _call(
    fn: Callable, atoms: Sequence[Atom], made, origins: Sequence[Origin | None] = ()
) -> _Piece:
    """Flattens the jaxpr of `fn` applied to `atoms`."""
    if all(isinstance(a, Const) for a in atoms):
        out = fn(*(a.value for a in atoms))
        return _Piece([Const(x) for x in (out if isinstance(out, list) else [out])])
    specs = [
        jax.ShapeDtypeStruct(np.shape(a.value), np.result_type(a.value))
        if isinstance(a, Const)
        else jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype)
        for a in atoms
    ]
    return _inline(_compat.make_jaxpr(fn, *specs), atoms, made, origins)


def _step_slice(a: Atom, step: int, made) -> _Piece:
    """`a[step]`; a new scan unit when `a` is a parameter leaf or unit.

    A slice already cut by another scan is no new unit: the detector then sees its
    stacked leaf read outside the first scan and says so.
    """
    origin = a.origin if isinstance(a, PVar) else None
    if origin is not None:
        key = (origin.leaf, origin.index + (step,))
        exact = origin.exact and key not in made
        origin = Origin(key[0], key[1], exact)
    piece = _call(
        lambda x: jax.lax.index_in_dim(x, step, keepdims=False), [a], made, [origin]
    )
    (out,) = piece.outs
    if origin is None or not origin.exact or not isinstance(out, PVar):
        return piece
    unit = Unit(out, origin.leaf, origin.index, a, piece.nodes)  # pyright: ignore
    return piece._replace(units=piece.units + (unit,))


def _slice_all(atoms: Sequence[Atom], step: int, made) -> _Piece:
    """`[a[step] for a in atoms]`, cutting units from parameters."""
    outs, nodes, units = [], [], []
    for a in atoms:
        piece = _step_slice(a, step, made | _unit_keys(units))
        outs.extend(piece.outs)
        nodes.extend(piece.nodes)
        units.extend(piece.units)
    return _Piece(outs, tuple(nodes), tuple(units))


def _unrolls(eqn) -> bool:
    return (
        eqn.primitive.name == "scan"
        and 0 < eqn.params["length"] <= current_config().max_unroll
        and _compat.call_body_of(eqn.params["jaxpr"]) is not None
    )


def _unroll(eqn, atoms: Sequence[Atom], made) -> _Piece:
    """Inlines every step of a scan, cutting its stacked parameters into units."""
    p = eqn.params
    (n_c, n_carry), length = _compat.scan_counts(eqn), p["length"]
    consts, carry = list(atoms[:n_c]), list(atoms[n_c : n_c + n_carry])
    xs = atoms[n_c + n_carry :]
    body = _compat.call_body_of(p["jaxpr"])
    steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
    pieces, ys_steps = [], {}
    for step in steps:
        x = _slice_all(xs, step, made | _unit_keys(_units_of(pieces)))
        so_far = made | _unit_keys(_units_of(pieces) + x.units)
        inlined = _inline(body, consts + carry + x.outs, so_far)
        pieces += [x, inlined]
        carry, ys_steps[step] = inlined.outs[:n_carry], inlined.outs[n_carry:]
    for j, v in enumerate(eqn.outvars[n_carry:]):
        if _compat.is_drop_var(v):
            pieces.append(_Piece([None]))
            continue
        parts = [ys_steps[t][j] for t in range(length)]
        pieces.append(_call(lambda *y: jnp.stack(y), parts, made))
    ys = [o for piece in pieces[2 * length :] for o in piece.outs]
    return _Piece(carry + ys, _nodes_of(pieces), _units_of(pieces))


def _ungroup(eqn, atoms: Sequence[Atom], made) -> _Piece:
    """Cuts a declared layer with groups into one declared layer per group, each
    reading its own unit of the grouped weight."""
    params = dict(eqn.params, groups=eqn.params["groups"] - 1)
    pieces = []
    for group in range(eqn.outvars[0].aval.shape[0]):
        cut = _slice_all(atoms, group, made | _unit_keys(_units_of(pieces)))
        tagged = _call(lambda *ops: layer_tag_p.bind(*ops, **params), cut.outs, made)
        pieces += [cut, tagged]
    parts = [o for piece in pieces[1::2] for o in piece.outs]
    stacked = _call(lambda *y: jnp.stack(y), parts, made)
    return _Piece(stacked.outs, _nodes_of(pieces + [stacked]), _units_of(pieces))


def _nodes_of(pieces: Sequence[_Piece]) -> tuple[Node, ...]:
    return tuple(n for piece in pieces for n in piece.nodes)


def _units_of(pieces: Sequence[_Piece]) -> tuple[Unit, ...]:
    return tuple(u for piece in pieces for u in piece.units)


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
