"""A jaxpr flattened into one list of equations, and its interpreter.

Nested `jit`, `jax.checkpoint` and custom-derivative calls that carry parameters or
a loss tag are inlined, so that layers inside them are visible and can be perturbed.
A `scan` that reads parameters (stacked layers as `xs`, or shared weights as
consts) stays a scan, a `ScanNode` holding its flattened body: each step's slice of
a stacked leaf is a *unit*, a parameter of its own, and a variable of the body at
step `t` is a `StepVar`; the interpreter perturbs such variables through the scan's
`xs` and reads them back as its `ys`, so the program does not grow with the number
of steps. The scans it cannot keep (nested scans over stacked leaves, a parameter
in the carry, a loss registered inside) are unrolled, up to `Config.max_unroll`
steps. Every other equation (`relu`'s custom JVP, `cond`, longer scans, ...) stays
one opaque node evaluated as a whole, so its own derivative rules are kept.
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
from .losses import loss_tag_p, loss_value_tag_p


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


class StepVar(PVar):
    """Variable `base` of a scan body at step `step`.

    Its values for all steps are one array, the variable `stacked` (`(length,
    *base.shape)`): the interpreter reads it from the scan's `ys` and perturbs it
    through the scan's `xs`.
    """

    __slots__ = ("base", "step", "stacked")

    def __init__(self, base: PVar, step: int, stacked: PVar, origin=None):
        super().__init__(base.aval, origin)
        self.base = base
        self.step = step
        self.stacked = stacked

    def __repr__(self) -> str:
        return f"StepVar({self.aval.str_short()}, step={self.step})"


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


# The step index of a scan unit in the symbolic program detection reads: the
# layers of one step stand for those of every step.
SYMBOLIC = -1


@dataclasses.dataclass(frozen=True, eq=False)
class ScanNode(Node):
    """A `scan` that reads parameters, kept as a scan around its flattened body.

    The body reads the scan's consts as the outer atoms themselves (a parameter
    leaf is itself inside the body), its carry as `carry_in` and its scanned inputs
    as `xs_in`; a stacked parameter leaf's `xs_in` variable is the symbolic unit
    `(leaf, (SYMBOLIC,))`. `units` are the real units, `leaf[t]` for every step,
    each held by a `StepVar`.
    """

    consts: tuple[Atom, ...] = ()
    carry: tuple[Atom, ...] = ()
    xs: tuple[Atom, ...] = ()
    carry_in: tuple[PVar, ...] = ()
    xs_in: tuple[PVar, ...] = ()
    body: tuple[Node, ...] = ()
    body_outs: tuple[Atom, ...] = ()
    length: int = 0
    reverse: bool = False
    symbolic: tuple["Unit", ...] = ()
    units: tuple["Unit", ...] = ()
    # id of a body variable -> (the variable, its stacked variable), made on demand.
    stacks: dict = dataclasses.field(default_factory=dict)

    @property
    def steps(self) -> range:
        """The steps in the order the scan runs them."""
        return range(self.length - 1, -1, -1) if self.reverse else range(self.length)

    def body_vars(self) -> set[int]:
        """Ids of the variables defined inside the body."""
        out = {id(v) for v in self.carry_in + self.xs_in}
        out.update(id(o) for n in self.body for o in n.outs if o is not None)
        return out

    def step_var(self, var: PVar, step: int, origin: "Origin | None" = None) -> StepVar:
        """Body variable `var` at `step`."""
        if id(var) not in self.stacks:
            shape = (self.length,) + var.aval.shape
            stacked = PVar(jax.core.ShapedArray(shape, var.aval.dtype))
            self.stacks[id(var)] = (var, stacked)
        return StepVar(var, step, self.stacks[id(var)][1], origin)


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


def symbolic(program: Program) -> Program:
    """The program layer detection reads: each `ScanNode` replaced by one step of
    its body, whose stacked parameters are the symbolic units, between three
    links — `enter` (the scan's carry and `xs` into the body), `loop` (the body's
    carry back into itself) and `leave` (the body's results out of the scan). The
    links carry the scan's equation, so they match no layer and read as `scan`."""
    if not any(isinstance(n, ScanNode) for n in program.nodes):
        return program
    nodes: list[Node] = []
    for node in program.nodes:
        if not isinstance(node, ScanNode):
            nodes.append(node)
            continue
        n_carry = len(node.carry)
        pvars = lambda atoms: tuple(a for a in atoms if isinstance(a, PVar))  # noqa: E731
        enter = Node(
            node.eqn, pvars(node.carry + node.xs), node.carry_in + node.xs_in, node.fn
        )
        loop = Node(node.eqn, pvars(node.body_outs[:n_carry]), node.carry_in, node.fn)
        leave = Node(node.eqn, pvars(node.body_outs), node.outs, node.fn)
        symbolic_units = tuple(
            dataclasses.replace(u, nodes=(enter,)) for u in node.symbolic
        )
        object.__setattr__(node, "symbolic", symbolic_units)
        nodes += [enter, loop, *node.body, leave]
    units: list[Unit] = []
    owner = {
        id(u): n for n in program.nodes if isinstance(n, ScanNode) for u in n.units
    }
    done: set[int] = set()
    for u in program.units:
        scan = owner.get(id(u))
        if scan is None:
            units.append(u)
        elif id(scan) not in done:
            done.add(id(scan))
            units.extend(scan.symbolic)
    return Program(program.invars, tuple(nodes), program.outvars, tuple(units))


def scan_nodes(program: Program) -> tuple[ScanNode, ...]:
    return tuple(n for n in program.nodes if isinstance(n, ScanNode))


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
    if reads_params and eqn.primitive.name == "scan":
        kept = _keep_scan(eqn, atoms, made)
        if kept is not None:
            return kept
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


def _contains_tag(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is loss_tag_p or eqn.primitive is loss_value_tag_p:
            return True
        body = _compat.call_body(eqn)
        if body is None and eqn.primitive.name == "scan":
            body = _compat.call_body_of(eqn.params["jaxpr"])
        if body is not None and _contains_tag(body[0]):
            return True
    return False


def _keep_scan(eqn, atoms: Sequence[Atom], made) -> _Piece | None:
    """The scan as a `ScanNode`, or None where it must be unrolled: a parameter
    (or a view of one) in the carry or sliced from something other than a whole
    leaf, a leaf already cut by another scan, a loss registered inside, or a body
    that itself cuts units (a nested scan over the stacked leaves)."""
    p = eqn.params
    body = _compat.call_body_of(p["jaxpr"])
    length = p["length"]
    if body is None or length < 1 or _contains_tag(body[0]):
        return None
    n_c, n_carry = _compat.scan_counts(eqn)
    consts, carry = tuple(atoms[:n_c]), tuple(atoms[n_c : n_c + n_carry])
    xs = tuple(atoms[n_c + n_carry :])
    if any(_holds_param(a) for a in carry):
        return None
    cut = {leaf for leaf, _ in made}
    stacked = [a for a in xs if _holds_param(a)]
    for a in stacked:
        if a.origin.index or not a.origin.exact or a.origin.leaf in cut:  # pyright: ignore
            return None
    if len({a.origin.leaf for a in stacked}) != len(stacked):  # pyright: ignore
        return None
    invars = body[0].invars
    carry_in = tuple(PVar(v.aval) for v in invars[n_c : n_c + n_carry])
    xs_in = tuple(
        PVar(v.aval, Origin(a.origin.leaf, (SYMBOLIC,)) if _holds_param(a) else None)  # pyright: ignore
        for v, a in zip(invars[n_c + n_carry :], xs)
    )
    inner = _inline(body, consts + carry_in + xs_in, made)
    if inner.units or any(isinstance(n, ScanNode) for n in inner.nodes):
        return None
    if any(o is None for o in inner.outs):
        return None
    outs = tuple(None if _compat.is_drop_var(v) else PVar(v.aval) for v in eqn.outvars)
    args = tuple(_atom_of(eqn, atoms, v) for v in _compat.unique_invars(eqn))
    node = ScanNode(
        eqn,
        args,
        outs,
        _compat.eqn_evaluator(eqn),
        consts=consts,
        carry=carry,
        xs=xs,
        carry_in=carry_in,
        xs_in=xs_in,
        body=inner.nodes,
        body_outs=tuple(inner.outs),  # pyright: ignore
        length=length,
        reverse=p["reverse"],
    )
    symbolic, units = [], []
    for v, a in zip(xs_in, xs):
        if _holds_param(a):
            symbolic.append(Unit(v, a.origin.leaf, (SYMBOLIC,), a, ()))  # pyright: ignore
    for step in node.steps:
        for v, a in zip(xs_in, xs):
            if _holds_param(a):
                origin = Origin(a.origin.leaf, (step,))  # pyright: ignore
                var = node.step_var(v, step, origin)
                units.append(Unit(var, origin.leaf, origin.index, a, ()))  # pyright: ignore
    object.__setattr__(node, "symbolic", tuple(symbolic))
    object.__setattr__(node, "units", tuple(units))
    return _Piece(list(outs), (node,), tuple(units))


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
        if isinstance(var, StepVar):
            # Values may carry leading batch axes (under `jax.vmap`): the step axis
            # is the one before the variable's own axes.
            value = self[var.stacked]
            axis = value.ndim - len(var.aval.shape) - 1
            return jax.lax.index_in_dim(value, var.step, axis, keepdims=False)
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
        if isinstance(a, Const):
            return a.value
        if isinstance(a, StepVar) and id(a) not in self.env:
            return self.env[id(a.stacked)][a.step]
        return self.env[id(a)]


def points(variables: Sequence[PVar]) -> list[PVar]:
    """The variables to perturb (or read) for `variables`, without repeats: a
    `StepVar` is perturbed through its stacked variable, for all steps at once."""
    out = {}
    for v in variables:
        key = v.stacked if isinstance(v, StepVar) else v
        out.setdefault(id(key), key)
    return list(out.values())


def evaluate(
    program: Program,
    inputs: Sequence[Any],
    perturbations: VarMap | None = None,
    *,
    stop_after_tags: int | None = None,
    reads: Sequence[Atom] = (),
) -> Evaluation:
    """Runs the program, adding `perturbations` to the variables they name.

    With `stop_after_tags=k`, stops right after the k-th loss tag (the rest of the
    program only turns tag outputs into the loss value). A `StepVar` can be read
    from the result only when it (or its stacked variable) is among `reads`: the
    scan then returns its values for every step.
    """
    env: dict[int, Any] = {id(v): x for v, x in zip(program.invars, inputs)}
    extra = perturbations.as_dict() if perturbations is not None else {}
    for k in set(env) & set(extra):
        env[k] = env[k] + extra[k]
    emit = {id(v.stacked if isinstance(v, StepVar) else v) for v in reads}
    ev = Evaluation(env, [], ())
    for node in program.nodes:
        args = [ev.read(a) for a in node.args]
        if node.eqn.primitive is loss_tag_p:
            values = [ev.read(node.operand(i)) for i in range(3)]
            ev.tags.append(tuple(values))
            outs = [values[0]]  # the tag is the identity on its inputs
        elif isinstance(node, ScanNode):
            outs = _run_scan(node, ev, extra, emit)
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


def _run_scan(
    node: ScanNode, ev: Evaluation, extra: Mapping[int, Any], emit: set[int]
) -> list[Any]:
    """Runs a kept scan: perturbations of body variables go in as `xs`, the body
    variables to read come out as `ys` (into `ev.env`, under their stacked
    variables)."""
    stacks = list(node.stacks.values())
    perturbed = [(v, extra[id(st)]) for v, st in stacks if id(st) in extra]
    emitted = [(v, st) for v, st in stacks if id(st) in emit]
    n_carry = len(node.carry)
    outer = ev.env

    def step(carry, x):
        xs, deltas = x
        env = dict(outer)
        env.update({id(v): c for v, c in zip(node.carry_in, carry)})
        env.update({id(v): c for v, c in zip(node.xs_in, xs)})
        inner = Evaluation(env, [], ())
        delta = {id(v): d for (v, _), d in zip(perturbed, deltas)}
        for k in set(env) & set(delta):
            env[k] = env[k] + delta[k]
        for n in node.body:
            outs = n.fn(*(inner.read(a) for a in n.args))
            for v, y in zip(n.outs, outs):
                if v is not None:
                    env[id(v)] = y + delta[id(v)] if id(v) in delta else y
        results = [inner.read(a) for a in node.body_outs]
        reads = [env[id(v)] for v, _ in emitted]
        return results[:n_carry], (results[n_carry:], reads)

    init = [ev.read(a) for a in node.carry]
    xs = [ev.read(a) for a in node.xs]
    deltas = [d for _, d in perturbed]
    carry, (ys, reads) = jax.lax.scan(
        step,
        init,
        (xs, deltas),
        length=node.length,
        reverse=node.reverse,
        unroll=node.params.get("unroll", 1),
    )
    for (_, st), r in zip(emitted, reads):
        ev.env[id(st)] = r
    return list(carry) + list(ys)
