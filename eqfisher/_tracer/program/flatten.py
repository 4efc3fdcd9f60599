"""Flattening a jaxpr into a `Program`: inlining calls that carry parameters or
loss tags, keeping the scans that read parameters as `ScanNode`s, unrolling the
others, and cutting stacked parameters into scan units.
"""

import contextvars
import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from ... import _compat
from ..._config import current_config
from ...losses import loss_tag_p, loss_value_tag_p
from ..declare import layer_tag_p
from .conv_layout import conv_evaluator
from .types import (
    STRUCTURAL,
    SYMBOLIC,
    Atom,
    Const,
    Node,
    Origin,
    Program,
    PVar,
    ScanNode,
    Unit,
    holds_param,
)


class _Piece(NamedTuple):
    """What flattening part of a jaxpr gives: the atoms of its outputs, its
    equations and the scan units it cut."""

    outs: list[Atom | None]  # None for a dropped output
    nodes: tuple[Node, ...] = ()
    units: tuple[Unit, ...] = ()


def _unit_keys(units: Sequence[Unit]) -> frozenset[tuple[int, tuple[int, ...]]]:
    return frozenset((u.leaf, u.index) for u in units)


def _walk_reading_steps(
    jaxpr, scope: Mapping[int, Atom], whole: frozenset[int]
) -> tuple[_Piece, frozenset[int]]:
    """`_walk` of the whole program, reading the one-step slices of parameter leaves
    not in `whole` as scan units (see `_one_step`); and the leaves of which such
    slices read only some steps. Their units would not cover the leaf (a table of
    which one row is read), so they are to be read whole."""
    reads: list[tuple[int, int]] = []
    token = _STEP_READS.set((whole, reads))
    try:
        piece = _walk(jaxpr, scope, frozenset())
    finally:
        _STEP_READS.reset(token)
    steps: dict[int, set[int]] = {}
    for leaf, step in reads:
        steps.setdefault(leaf, set()).add(step)
    shapes = [v.aval.shape for v in jaxpr.invars]
    partial = {k for k, got in steps.items() if got != set(range(shapes[k][0]))}
    return piece, frozenset(partial)


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
    scope: dict[int, Atom] = {id(v): Const(c) for v, c in zip(jaxpr.constvars, consts)}
    scope.update({id(v): p for v, p in zip(jaxpr.invars, invars)})
    piece, partial = _walk_reading_steps(jaxpr, scope, frozenset())
    if partial:  # once more, those leaves read whole
        piece, _ = _walk_reading_steps(jaxpr, scope, partial)
    # A walk's outputs are atoms (only an equation's dropped outputs are None); a
    # constant output is returned as an array, as `jax.jit` returns it.
    outvars = tuple(
        Const(_compat.constant_output(a.value, v.aval)) if isinstance(a, Const) else a
        for a, v in zip(cast(tuple[Atom, ...], piece.outs), jaxpr.outvars)
    )
    return Program(invars, piece.nodes, outvars, piece.units)


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
    outs: list[Atom | None] = [_atom(scope, v) for v in jaxpr.outvars]
    return _Piece(outs, tuple(nodes), tuple(units))


def _flatten_eqn(eqn, atoms, made, out_origins) -> _Piece:
    args = [_atom_of(eqn, atoms, v) for v in _compat.unique_invars(eqn)]
    body = _compat.call_body(eqn)
    reads_params = any(holds_param(a) for a in args)
    if body is not None and (reads_params or _contains_tag(body[0])):
        return _inline(body, atoms, made)
    if _registers_inside(eqn):
        return _unroll(eqn, atoms, made)
    if reads_params and eqn.primitive.name == "scan":
        kept = _keep_scan(eqn, atoms, made)
        if kept is not None:
            return kept
    if reads_params and _unrolls(eqn):
        return _unroll(eqn, atoms, made)
    if reads_params and eqn.primitive is layer_tag_p and eqn.params["groups"]:
        return _ungroup(eqn, atoms, made)
    step = _one_step(eqn, args)
    if step is not None:
        return _step_read(cast(PVar, args[0]), step, made)
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
    evaluator = conv_evaluator(eqn) or _compat.eqn_evaluator(eqn)
    node = Node(eqn, tuple(args), outs, evaluator)
    return _Piece(list(outs), (node,))


def _atom_of(eqn, atoms, v) -> Atom:
    return atoms[[id(u) for u in eqn.invars].index(id(v))]


def _inline(
    body, atoms: Sequence[Atom], made, origins: Sequence[Origin | None] = ()
) -> _Piece:
    """Flattens a call's body applied to `atoms`; `origins` are given to its
    outputs."""
    inner, inner_consts = body
    scope: dict[int, Atom] = {
        id(v): Const(c) for v, c in zip(inner.constvars, inner_consts)
    }
    scope.update({id(v): a for v, a in zip(inner.invars, atoms)})
    out_origins = {id(v): o for v, o in zip(inner.outvars, origins) if o is not None}
    return _walk(inner, scope, made, types.MappingProxyType(out_origins))


def _call(
    fn: Callable, atoms: Sequence[Atom], made, origins: Sequence[Origin | None] = ()
) -> _Piece:
    """Flattens the jaxpr of `fn` applied to `atoms`."""
    if all(isinstance(a, Const) for a in atoms):
        out = fn(*(a.value for a in atoms if isinstance(a, Const)))
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
    token = _CUTTING.set(True)
    try:
        piece = _call(
            lambda x: jax.lax.index_in_dim(x, step, keepdims=False), [a], made, [origin]
        )
    finally:
        _CUTTING.reset(token)
    (out,) = piece.outs
    if origin is None or not origin.exact or not isinstance(out, PVar):
        return piece
    unit = Unit(out, origin.leaf, origin.index, a, piece.nodes)  # pyright: ignore
    return piece._replace(units=piece.units + (unit,))


# Set while `_step_slice` flattens its own slice, which is no Python loop's read.
_CUTTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cutting", default=False
)
# While `flatten` walks a program: the leaves to read whole, and the (leaf, step)
# of the one-step reads made into units.
_STEP_READS: contextvars.ContextVar[tuple[frozenset[int], list] | None] = (
    contextvars.ContextVar("step_reads", default=None)
)


def _one_step(eqn, args: Sequence[Atom]) -> int | None:
    """`k` when `eqn` is `leaf[k:k + 1]` of a whole parameter leaf (or unit), all of
    its other axes whole: how `leaf[k]` reads one layer of a stacked leaf in a
    Python loop (`jax.tree.map(lambda x: x[k], stack)`, a `slice` then a
    `squeeze`); None otherwise."""
    reading = _STEP_READS.get()
    if eqn.primitive.name != "slice" or len(args) != 1 or _CUTTING.get():
        return None
    (a,) = args
    if not (isinstance(a, PVar) and a.origin is not None and a.origin.exact):
        return None
    if reading is None or a.origin.index or a.origin.leaf in reading[0]:
        return None  # a scan unit's slice, or a leaf to read whole
    shape = a.aval.shape
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    whole = all(
        start[i] == 0 and limit[i] == shape[i] and strides[i] == 1
        for i in range(1, len(shape))
    )
    one = len(shape) > 1 and limit[0] == start[0] + 1 and strides[0] == 1
    if not (whole and one):
        return None
    reading[1].append((a.origin.leaf, start[0]))
    return start[0]


def _step_read(a: PVar, step: int, made) -> _Piece:
    """`a[step:step + 1]`, as a scan unit `a[step]` with its leading axis put back:
    one step of a stacked leaf read in a Python loop is the layer an unrolled scan's
    step would be."""
    cut = _step_slice(a, step, made)
    (unit,) = cut.outs
    kept = _call(lambda x: x[None], [unit], made)  # pyright: ignore[reportArgumentType]
    return _Piece(kept.outs, cut.nodes + kept.nodes, cut.units + kept.units)


def _slice_all(atoms: Sequence[Atom], step: int, made) -> _Piece:
    """`[a[step] for a in atoms]`, cutting units from parameters."""
    outs, nodes, units = [], [], []
    for a in atoms:
        piece = _step_slice(a, step, made | _unit_keys(units))
        outs.extend(piece.outs)
        nodes.extend(piece.nodes)
        units.extend(piece.units)
    return _Piece(outs, tuple(nodes), tuple(units))


def _as_written(node: Node) -> Node:
    """`node` evaluated as its equation is written: a loop body keeps its
    convolutions' layouts (`conv_layout` helps only a `cond`'s, and would slow the
    weight cotangent's in a loop)."""
    if conv_evaluator(node.eqn) is None:
        return node
    return dataclasses.replace(node, fn=_compat.eqn_evaluator(node.eqn))


def _unrolls(eqn) -> bool:
    return (
        eqn.primitive.name == "scan"
        and 0 < _compat.scan(eqn).length <= current_config().max_unroll
        and _compat.scan(eqn).body is not None
    )


def _registers_inside(eqn) -> bool:
    """Whether `eqn` is a scan whose body registers a loss: it is unrolled, so that
    each step's registration is found, even when it reads no parameter. Refused
    when longer than `max_unroll`: the losses inside would go unseen."""
    if eqn.primitive.name != "scan":
        return False
    scan = _compat.scan(eqn)
    if scan.body is None or not _contains_tag(scan.body[0]):
        return False
    if not _unrolls(eqn):
        limit = current_config().max_unroll
        raise ValueError(
            f"`loss_fn` registers a loss inside a `jax.lax.scan` of {scan.length} "
            f"steps; eqfisher unrolls such scans to find each step's loss, up to "
            f"`max_unroll` ({limit}) steps. Raise the limit with "
            f"`eqfisher.configure(max_unroll={scan.length})`, or return the "
            "model outputs as the scan's outputs and register the loss once on "
            "them, outside the scan."
        )
    return True


def _contains_tag(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is loss_tag_p or eqn.primitive is loss_value_tag_p:
            return True
        body = _compat.call_body(eqn)
        if body is None and eqn.primitive.name == "scan":
            body = _compat.scan(eqn).body
        if body is not None and _contains_tag(body[0]):
            return True
    return False


def _keep_scan(eqn, atoms: Sequence[Atom], made) -> _Piece | None:
    """The scan as a `ScanNode`, or None where it must be unrolled: a parameter
    (or a view of one) in the carry or sliced from something other than a whole
    leaf, a leaf already cut by another scan, a loss registered inside, or a body
    that itself cuts units (a nested scan over the stacked leaves)."""
    scan = _compat.scan(eqn)
    body, length, n_c, n_carry = scan.body, scan.length, scan.num_consts, scan.num_carry
    if body is None or length < 1 or _contains_tag(body[0]):
        return None
    consts, carry = tuple(atoms[:n_c]), tuple(atoms[n_c : n_c + n_carry])
    xs = tuple(atoms[n_c + n_carry :])
    if any(holds_param(a) for a in carry):
        return None
    cut = {leaf for leaf, _ in made}
    stacked = [a for a in xs if holds_param(a)]
    for a in stacked:
        if a.origin.index or not a.origin.exact or a.origin.leaf in cut:  # pyright: ignore
            return None
    if len({a.origin.leaf for a in stacked}) != len(stacked):  # pyright: ignore
        return None
    invars = body[0].invars
    carry_in = tuple(PVar(v.aval) for v in invars[n_c : n_c + n_carry])
    xs_in = tuple(
        PVar(v.aval, Origin(a.origin.leaf, (SYMBOLIC,)) if holds_param(a) else None)  # pyright: ignore
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
        body=tuple(_as_written(n) for n in inner.nodes),
        body_outs=tuple(inner.outs),  # pyright: ignore
        length=length,
        reverse=scan.reverse,
    )
    symbolic, units = [], []
    for v, a in zip(xs_in, xs):
        if holds_param(a):
            symbolic.append(Unit(v, a.origin.leaf, (SYMBOLIC,), a, ()))  # pyright: ignore
    for step in node.steps:
        for v, a in zip(xs_in, xs):
            if holds_param(a):
                origin = Origin(a.origin.leaf, (step,))  # pyright: ignore
                var = node.step_var(v, step, origin)
                units.append(Unit(var, origin.leaf, origin.index, a, ()))  # pyright: ignore
    # The units' step variables come from the node (`ScanNode.step_var`), so the
    # node with them is a copy, sharing its `stacks`.
    node = dataclasses.replace(node, symbolic=tuple(symbolic), units=tuple(units))
    return _Piece(list(outs), (node,), tuple(units))


def _unroll(eqn, atoms: Sequence[Atom], made) -> _Piece:
    """Inlines every step of a scan, cutting its stacked parameters into units."""
    scan = _compat.scan(eqn)
    n_c, n_carry, length = scan.num_consts, scan.num_carry, scan.length
    consts, carry = list(atoms[:n_c]), list(atoms[n_c : n_c + n_carry])
    xs = atoms[n_c + n_carry :]
    body = scan.body
    steps = range(length - 1, -1, -1) if scan.reverse else range(length)
    pieces, ys_steps = [], {}
    for step in steps:
        x = _slice_all(xs, step, made | _unit_keys(_units_of(pieces)))
        so_far = made | _unit_keys(_units_of(pieces) + x.units)
        # A slice's and a walk's outputs are atoms (none dropped).
        inlined = _inline(body, cast(list[Atom], consts + carry + x.outs), so_far)
        pieces += [x, inlined]
        carry, ys_steps[step] = inlined.outs[:n_carry], inlined.outs[n_carry:]
    for j, v in enumerate(eqn.outvars[n_carry:]):
        if _compat.is_drop_var(v):
            pieces.append(_Piece([None]))
            continue
        parts = [ys_steps[t][j] for t in range(length)]
        pieces.append(_call(lambda *y: jnp.stack(y), parts, made))
    ys = [o for piece in pieces[2 * length :] for o in piece.outs]
    return _Piece([*carry, *ys], _nodes_of(pieces), _units_of(pieces))


def _ungroup(eqn, atoms: Sequence[Atom], made) -> _Piece:
    """Cuts a declared layer with groups into one declared layer per group, each
    reading its own unit of the grouped weight."""
    params = dict(eqn.params, groups=eqn.params["groups"] - 1)
    pieces = []
    for group in range(eqn.outvars[0].aval.shape[0]):
        cut = _slice_all(atoms, group, made | _unit_keys(_units_of(pieces)))
        ops = cast(list[Atom], cut.outs)  # a slice's outputs are atoms (none dropped)
        tagged = _call(lambda *o: layer_tag_p.bind(*o, **params), ops, made)
        pieces += [cut, tagged]
    parts = [o for piece in pieces[1::2] for o in piece.outs]
    stacked = _call(lambda *y: jnp.stack(y), parts, made)
    return _Piece(stacked.outs, _nodes_of(pieces + [stacked]), _units_of(pieces))


def _nodes_of(pieces: Sequence[_Piece]) -> tuple[Node, ...]:
    return tuple(n for piece in pieces for n in piece.nodes)


def _units_of(pieces: Sequence[_Piece]) -> tuple[Unit, ...]:
    return tuple(u for piece in pieces for u in piece.units)
