"""Candidates, one per layer-shaped equation: layer detection's step after `graph`.

One matcher per layer kind (dense, conv, scale-and-shift, embedding, a declared
layer) turns an equation into a `Candidate` of its kind (a type from `kinds`);
`candidates` adds each one's bias and the shift-only layers.
"""

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast

import jax

from ... import _compat
from ..analyses import axes
from ..analyses.axes import Feature, OutputLabel, output_labels
from ..declare import layer_tag_p
from ..program import STRUCTURAL, Const, Node, PVar
from .graph import Graph, View
from .kinds import (
    AbstractLayerKind,
    ConvKind,
    DenseKind,
    EmbeddingKind,
    ScaleAndShiftKind,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
    kind: AbstractLayerKind
    core: Node
    weight: View | None
    bias: View | None
    activation: Any
    in_order: tuple[int, ...]
    d_in: int
    weight_perm: tuple[int, ...] | None
    # The variable perturbed: the core's output, or after its bias; None for a
    # declaration whose result is unused (`judge` drops it).
    outputs: PVar | None
    out_labels: tuple[OutputLabel, ...]
    chain: tuple[Node, ...] = ()  # the equations from the core to `outputs`
    # For a declared layer: the equations computing it from its parameters.
    computes: frozenset[int] = frozenset()

    @property
    def param_views(self) -> tuple[View, ...]:
        return tuple(v for v in (self.weight, self.bias) if v is not None)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(v.index for v in self.param_views)

    @property
    def declared(self) -> bool:
        return self.core.eqn.primitive is layer_tag_p


def _full_perm(view: View, axes: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """Leaf axes in the order of view axes `axes`, if that is a permutation."""
    perm = tuple(view.labels[a] for a in axes)
    if None in perm or sorted(perm) != list(range(rank)):  # pyright: ignore[reportArgumentType]
        return None
    return perm  # pyright: ignore[reportReturnType]


def _shape(atom) -> tuple[int, ...]:
    if isinstance(atom, Const):
        return tuple(getattr(atom.value, "shape", ()))
    return tuple(atom.aval.shape)


def _param_and_activation(graph: Graph, p_atom, x_atom) -> View | None:
    """The view of `p_atom` when it is a parameter and `x_atom` is not."""
    if id(p_atom) not in graph.views or id(x_atom) in graph.views:
        return None
    return graph.views[id(p_atom)]


def _dense(node: Node, graph: Graph) -> Candidate | None:
    (lc, rc), (lb, rb) = _compat.param(node.eqn, "dimension_numbers")
    lhs, rhs = node.operand(0), node.operand(1)
    for w_atom, x_atom, wc, xc, wb, w_is_lhs in (
        (lhs, rhs, lc, rc, lb, True),
        (rhs, lhs, rc, lc, rb, False),
    ):
        view = _param_and_activation(graph, w_atom, x_atom)
        if view is None or wb:
            continue
        w_rank, x_shape = len(_shape(w_atom)), _shape(x_atom)
        w_free = [a for a in range(w_rank) if a not in wc]
        x_free = [a for a in range(len(x_shape)) if a not in xc]
        perm = _full_perm(view, w_free + list(wc), len(graph.shapes[view.index]))
        if perm is None:
            continue
        first = 0 if w_is_lhs else len(x_free)
        features = range(first, first + len(w_free))
        labels = output_labels(len(w_free) + len(x_free), features)
        d_in = math.prod(x_shape[a] for a in xc)
        in_order = tuple(x_free) + tuple(xc)
        return _core_candidate(
            DenseKind(), node, view, x_atom, labels, in_order, perm, d_in
        )
    return None


def _core_candidate(kind, node, view, x_atom, labels, in_order, perm, d_in):
    return Candidate(
        kind=kind,
        core=node,
        weight=view,
        bias=None,
        activation=x_atom,
        in_order=in_order,
        d_in=d_in,
        weight_perm=perm,
        outputs=node.outs[0],
        out_labels=labels,
    )


def _conv(node: Node, graph: Graph) -> Candidate | None:
    lhs, rhs = node.operand(0), node.operand(1)
    view = _param_and_activation(graph, rhs, lhs)
    # Grouped convolutions are block-diagonal in the channels: no one Kronecker
    # factor pair fits them, so they stay unmatched (diagonal).
    if view is None or _compat.param(node.eqn, "batch_group_count") != 1:
        return None
    dn = _compat.param(node.eqn, "dimension_numbers")
    rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
    perm = _full_perm(view, rhs_spec, len(graph.shapes[view.index]))
    if perm is None:
        return None
    labels = output_labels(len(out_spec), (out_spec[1],))
    k_shape = _shape(rhs)
    d_in = math.prod(k_shape[a] for a in rhs_spec[1:])
    return _core_candidate(ConvKind(), node, view, lhs, labels, (), perm, d_in)


def _elementwise(node: Node, graph: Graph) -> Candidate | None:
    """`x * scale` (or `x + shift`) with a parameter broadcast along locations."""
    a, b = node.operand(0), node.operand(1)
    out_shape = tuple(node.eqn.outvars[0].aval.shape)
    for p_atom, x_atom in ((a, b), (b, a)):
        view = _param_and_activation(graph, p_atom, x_atom)
        if view is None or isinstance(x_atom, Const):
            continue
        p_shape = _shape(p_atom)
        if _shape(x_atom) != out_shape or len(p_shape) != len(out_shape):
            continue
        feat_axes = _scale_features(view, p_shape, graph.shapes[view.index])
        if feat_axes is None:
            continue
        labels = output_labels(len(out_shape), feat_axes)
        is_scale = node.name == "mul"
        return Candidate(
            kind=ScaleAndShiftKind(),
            core=node,
            weight=view if is_scale else None,
            bias=None if is_scale else view,
            activation=x_atom,
            in_order=axes.location_axes(labels) + feat_axes,
            d_in=math.prod(graph.shapes[view.index]),
            weight_perm=None,
            outputs=cast(PVar, node.outs[0]),  # read: `candidates` checked
            out_labels=labels,
        )
    return None


def _scale_features(view: View, p_shape, leaf_shape) -> tuple[int, ...] | None:
    """The axes a scale or shift varies along, if it is one, in leaf order."""
    leaf_size = math.prod(leaf_shape)
    if len(leaf_shape) == 0 or leaf_size <= 1:
        return None  # a scalar (temperature, ...) is no layer
    # Feature axes are those the leaf varies along; an axis with no leaf origin
    # was created by broadcasting (GroupNorm broadcasts its weight to the full
    # shape), so the parameter is constant along it: a location.
    feat_axes = tuple(
        ax for ax, n in enumerate(p_shape) if view.labels[ax] is not None and n != 1
    )
    leaf_axes = [view.labels[ax] for ax in feat_axes]
    if leaf_axes != sorted(leaf_axes):  # pyright: ignore[reportArgumentType]
        return None
    if math.prod(p_shape[ax] for ax in feat_axes) != leaf_size:
        return None
    return feat_axes


def _embedding(node: Node, graph: Graph) -> Candidate | None:
    """A gather of whole rows of a `(vocab, features)` table.

    `table[ids]` gathers with the row index alone; `jax.vmap` of
    `eqx.nn.Embedding` gathers `(1, features)` slices at `(row, 0)` and squeezes the
    row axis. Both are accepted: the row must be indexed, every other indexed axis
    sliced whole (so its start index is 0).
    """
    table, indices = node.operand(0), node.operand(1)
    view = _param_and_activation(graph, table, indices)
    if view is None or not _gathers_rows(node, _shape(table), _shape(indices)):
        return None
    perm = _full_perm(view, (1, 0), 2)
    if perm is None:
        return None
    dn = _compat.param(node.eqn, "dimension_numbers")
    out_rank = len(node.eqn.outvars[0].aval.shape)
    row = dn.offset_dims[0] if dn.collapsed_slice_dims == () else None  # size 1
    labels = output_labels(
        out_rank, (dn.offset_dims[-1],), () if row is None else (row,)
    )
    start_map = tuple(dn.start_index_map)
    mode = _compat.param(node.eqn, "mode", None)
    # Only a clipping gather's derivative lands on the row it read for an id
    # outside the table: XLA's scatter (the derivative) skips such an id otherwise,
    # even where the gather clamped it (`table[ids]`).
    drops = mode != jax.lax.GatherScatterMode.CLIP
    return _core_candidate(
        EmbeddingKind(drops=drops), node, view, indices, labels,
        (start_map.index(0),), perm, _shape(table)[0],
    )  # fmt: skip


def _gathers_rows(node: Node, t_shape, i_shape) -> bool:
    dn, sizes = (
        _compat.param(node.eqn, "dimension_numbers"),
        tuple(_compat.param(node.eqn, "slice_sizes")),
    )
    start_map = tuple(dn.start_index_map)
    return (
        len(t_shape) == 2
        and 0 in start_map
        and all(d == 0 or t_shape[d] == sizes[d] for d in start_map)
        and tuple(dn.collapsed_slice_dims) in ((), (0,))
        and _compat.gather_batching_dims(dn)[0] == ()
        and sizes == (1, t_shape[1])
        and i_shape[-1:] == (len(start_map),)
    )


class _Declaration(NamedTuple):
    weight: View
    perm: tuple[int, ...]
    bias: View | None


def _declaration(node: Node, graph: Graph) -> _Declaration | str:
    """The parameters of a `register_dense` declaration, or why it declares none."""
    view = _param_and_activation(graph, node.operand(2), node.operand(1))
    if view is None:
        return (
            "its weight `w` is no parameter leaf, transpose of one or step of a "
            "stacked one (one computed from a parameter, as `2 * w` or `w + 0`, "
            "is not), or its input `x` is one: pass the parameter itself as `w`"
        )
    perm = _full_perm(view, (1, 0), len(graph.shapes[view.index]))
    if perm is None:
        return "its weight `w` is no whole (d_in, d_out) matrix of a parameter"
    bias = _declared_bias(node, graph, view)
    if bias is False:
        return "its bias `b` is no 1-D parameter leaf of its own, as it must be"
    return _Declaration(view, perm, bias)


def declaration_fault(node: Node, graph: Graph) -> str | None:
    """Why a `register_dense` tag declares no layer; None for other equations and
    for a declaration that does (or one cut per group: see `program.flatten`)."""
    if node.eqn.primitive is not layer_tag_p or node.params["groups"]:
        return None
    found = _declaration(node, graph)
    return found if isinstance(found, str) else None


def _repeated(node: Node, graph: Graph) -> list[Node]:
    """The declarations of the same layer that tag `node`'s output again: the same
    `x`, `w` and `b`, the `y` being `node`'s result. They declare no second use."""
    out = node.outs[0] if node.outs else None
    repeats = [
        user
        for user in graph.consumers.get(id(out), [])
        if user.eqn.primitive is layer_tag_p
        and user.params == node.params
        and user.operand(0) is out
        and all(a is b for a, b in zip(user.operands[1:], node.operands[1:]))
    ]
    return repeats + [r for user in repeats for r in _repeated(user, graph)]


def _repeats(node: Node, graph: Graph) -> bool:
    """Whether `node` declares again the layer another declaration's output is."""
    return any(
        node in _repeated(other, graph)
        for other in graph.consumers.get(id(node.operand(1)), [])
        if other is not node and other.eqn.primitive is layer_tag_p
    )


def _declared(node: Node, graph: Graph) -> Candidate | None:
    """A dense layer tagged with `eqfisher.register_dense`: `y = x @ w (+ b)`."""
    if node.params["groups"] or _repeats(node, graph):
        return None  # per group: no parameter slices; repeated: one layer
    found = _declaration(node, graph)
    if isinstance(found, str):
        return None
    view, perm, bias = found
    y, x = node.operand(0), node.operand(1)
    y_rank, x_rank = len(_shape(y)), len(_shape(x))
    declared = Candidate(
        kind=DenseKind(),
        core=node,
        weight=view,
        bias=bias,
        activation=x,
        in_order=tuple(range(x_rank)),
        d_in=_shape(x)[-1],
        weight_perm=perm,
        outputs=node.outs[0],
        out_labels=output_labels(y_rank, (y_rank - 1,)),
    )
    repeats = frozenset(id(r) for r in _repeated(node, graph))
    return dataclasses.replace(
        declared, computes=_computing(graph, declared, y) | repeats
    )


def _declared_bias(
    node: Node, graph: Graph, weight: View
) -> View | Literal[False] | None:
    """The bias view of a declared layer; False when its bias is no 1-D parameter."""
    if not node.params["has_bias"]:
        return None
    view = graph.views.get(id(node.operand(3)))
    if (
        view is None
        or view.index == weight.index
        or view.labels != (0,)
        or len(graph.shapes[view.index]) != 1
    ):
        return False
    return view


def _computing(graph: Graph, cand: Candidate, y) -> frozenset[int]:
    """The equations between a declared layer's parameters and its output `y`."""
    down = {id(v) for i in cand.indices for v in graph.lineage(i)}
    below: set[int] = set()
    for node in graph.program.nodes:
        if any(id(a) in down for a in node.args):
            below.add(id(node))
            down.update(id(o) for o in node.outs if o is not None)
    up, between = {id(y)}, set()
    for node in reversed(graph.program.nodes):
        if any(o is not None and id(o) in up for o in node.outs):
            up.update(id(a) for a in node.args)
            if id(node) in below:
                between.add(id(node))
    return frozenset(between)


_CORE_MATCHERS: Mapping[str, Callable[[Node, Graph], Candidate | None]] = (
    types.MappingProxyType(
        {
            "dot_general": _dense,
            "conv_general_dilated": _conv,
            "mul": _elementwise,
            "gather": _embedding,
            layer_tag_p.name: _declared,
        }
    )
)


def _with_bias(cand: Candidate, graph: Graph) -> Candidate:
    """Follows the core output through relayouts to an `add` of a parameter."""
    if cand.declared:
        return cand
    var, labels, chain = cand.outputs, cand.out_labels, ()
    while len(users := graph.consumers.get(id(var), [])) == 1:
        (user,) = users
        if user.outs[0] is None:  # nothing reads it (jax 0.9 keeps the equation)
            return cand
        if user.name == "add" and cand.kind.takes_bias:
            bias = _bias_of(cand, user, var, labels, graph)
            if bias is None:
                return cand
            return dataclasses.replace(
                cand,
                bias=bias,
                chain=chain + (user,),
                outputs=user.outs[0],
                out_labels=labels,
            )
        if user.name not in STRUCTURAL or user.operand(0) is not var:
            return cand
        new = axes.follow(user, labels)
        if new is None or {lab for lab in new if lab} != {lab for lab in labels if lab}:
            return cand
        var, labels, chain = user.outs[0], new, chain + (user,)
    return cand


def _bias_of(cand: Candidate, add: Node, var, labels, graph: Graph) -> View | None:
    other = [a for a in add.operands if a is not var]
    if len(other) != 1 or id(other[0]) not in graph.views:
        return None
    bview = graph.views[id(other[0])]
    if cand.weight is not None and bview.index == cand.weight.index:
        return None
    if not _bias_fits(bview, _shape(other[0]), labels, _shape(var)):
        return None
    return bview


def _bias_fits(bview: View, b_shape, labels, out_shape) -> bool:
    if len(b_shape) != len(out_shape):
        return False
    feats = []
    for p, (nb, no) in enumerate(zip(b_shape, out_shape, strict=False)):
        if not isinstance(labels[p], Feature):
            # Constant along locations: size 1, or broadcast (no leaf origin).
            if nb != 1 and bview.labels[p] is not None:
                return False
            continue
        if nb != no:
            return False
        if nb != 1:
            if bview.labels[p] is None:
                return False
            feats.append((bview.labels[p], labels[p].index))
    feats.sort()
    return [f for _, f in feats] == sorted(f for _, f in feats)


def candidates(graph: Graph) -> tuple[Candidate, ...]:
    """Every layer-shaped equation, then the shift-only layers (an `add` of a
    parameter nobody took as a bias). A declared layer's parameters are its own:
    equations that also match inside its computation are no layers."""
    # An equation whose output nothing reads (jax 0.9 keeps them) is no layer:
    # it adds no curvature. A declaration is kept either way: one whose result is
    # unused still claims its parameters, and `judge` names the mistake.
    read = [
        n
        for n in graph.program.nodes
        if n.outs and (n.outs[0] is not None or n.eqn.primitive is layer_tag_p)
    ]
    cores = []
    for node in read:
        match = _CORE_MATCHERS.get(node.name)
        if match is not None and (cand := match(node, graph)) is not None:
            cores.append(_with_bias(cand, graph))
    taken = {id(c.chain[-1]) for c in cores if c.chain}
    shifts = [
        cand
        for node in read
        if node.name == "add" and id(node) not in taken
        if (cand := _elementwise(node, graph)) is not None
    ]
    declared = {i for c in cores if c.declared for i in c.indices}
    return tuple(
        c for c in cores + shifts if c.declared or not declared.intersection(c.indices)
    )
