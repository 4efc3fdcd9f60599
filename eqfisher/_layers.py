"""Layer kinds and their detection on a flattened program.

Detection works on equations, not on module types, so `eqx.nn.Linear` under
`jax.vmap`, a raw `x @ w + b`, an `einsum` and an attention projection are all the
same thing to it: a `dot_general` with a parameter on one side, perhaps followed by a
bias added along the output features. A layer declared with
`eqfisher.register_dense` is found by its tag, whatever computes it.

`detect` runs in phases, each a function from values to values:

1. `_Graph.of`: facts about the program (parameter views, consumers, what reaches
   a registered loss);
2. `_candidates`: one `_Candidate` per layer-shaped equation, with its bias;
3. `_judge`: which candidates cannot be a Kronecker-factored layer, and why
   (weights shared between layouts, used outside the layer, or sliced by a scan
   and read another way) — a `_Verdict`;
4. `_records` and `_unmatched`: the kept layers in model order, and a reason for
   every parameter in none.
"""

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx

from . import _axes
from ._axes import Feature, OutputLabel, output_labels
from ._config import current_config
from ._declare import layer_tag_p
from ._program import (
    STRUCTURAL,
    SYMBOLIC,
    Const,
    Node,
    Program,
    PVar,
    ScanNode,
    scan_nodes,
    symbolic,
)
from .losses import loss_tag_p


LayerKind = Literal["dense", "conv", "scale_and_shift", "embedding"]


class LayerInfo(eqx.Module):
    """A layer found by the tracer.

    **Fields:**

    - `name`: the model path of the layer, e.g. `layers[0]`.
    - `kind`: one of `"dense"`, `"conv"`, `"scale_and_shift"`, `"embedding"`.
    - `param_paths`: the `jax.tree_util.keystr` paths of its parameter leaves, in
      model order (weight before bias).
    - `uses`: how often the layer is applied (more than 1 for tied weights; K-FAC
      then pools the applications' statistics into one Kronecker block).

    !!! Example

        ```python
        first, second = ef.find_layers(loss_fn, model, batch).layers
        assert first.name == "layers[0]" and first.kind == "dense"
        assert first.param_paths == (".layers[0].weight", ".layers[0].bias")

        linear = eqx.nn.Linear(4, 4, key=key)
        tied = lambda m, b: ef.softmax_cross_entropy(
            jax.vmap(lambda v: m(jnp.tanh(m(v))))(b[0]), b[1]
        )
        (info,) = ef.find_layers(tied, linear, batch).layers
        assert info.uses == 2  # one layer, applied twice
        ```
    """

    name: str = eqx.field(static=True)
    kind: LayerKind = eqx.field(static=True)
    param_paths: tuple[str, ...] = eqx.field(static=True)
    uses: int = eqx.field(static=True, default=1)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerRecord:
    """Everything the curvature code needs to know about one detected layer.

    `inputs`/`outputs` are program variables: the activation (or the indices of an
    embedding) and the output that is perturbed to read output cotangents.
    `in_order` orders the input axes as (locations..., contracted...), `out_order`
    the output axes as (locations..., features...); reshaping after these transposes
    gives the `(locations, d_in)` and `(locations, d_out)` matrices K-FAC uses.
    For a conv, `in_order` is `()` (its inputs need patches, see `core.params`); for
    an embedding, `inputs` are the gather's integer indices `(*locations, k)` and
    `in_order` is `(c,)`: the row ids are `inputs[..., c]`.
    `weight_perm` maps the weight leaf to its `(d_out, d_in)` matrix view (None for
    a scale-and-shift layer). `core` is the layer's main equation (for a declared
    layer, its tag).
    """

    info: LayerInfo
    param_indices: tuple[int, ...]
    inputs: Any
    outputs: PVar
    in_order: tuple[int, ...]
    out_order: tuple[int, ...]
    d_in: int
    d_out: int
    weight_perm: tuple[int, ...] | None
    core: Node

    @property
    def kind(self) -> LayerKind:
        return self.info.kind


@dataclasses.dataclass(frozen=True)
class Detection:
    layers: tuple[LayerRecord, ...]
    unmatched: tuple[tuple[str, str], ...]  # (path, reason)


# ---------------------------------------------------------------------------
# Phase 1: facts about the program.


class _View(NamedTuple):
    """A parameter seen through structural equations."""

    index: int  # which parameter (leaf or scan unit)
    labels: tuple[int | None, ...]  # each axis: the leaf axis it comes from, or None
    nodes: tuple[Node, ...]  # the structural equations between the parameter and here


def sources(program: Program, num_params: int) -> list[PVar]:
    """The variable of each parameter index: the leaves, then the scan units."""
    return list(program.invars[:num_params]) + [u.var for u in program.units]


def unit_paths(program: Program, leaf_paths: Sequence[str]) -> list[str]:
    """The path of each parameter index: `.layers.weight`, `.layers.weight[2]`."""
    return list(leaf_paths) + [
        leaf_paths[u.leaf] + "".join(f"[{i}]" for i in u.index) for u in program.units
    ]


def _views(program: Program, srcvars: Sequence[PVar]) -> dict[int, _View]:
    views = {
        id(v): _View(i, tuple(range(len(v.aval.shape))), ())
        for i, v in enumerate(srcvars)
    }
    for node in program.nodes:
        if node.name not in STRUCTURAL or not node.args:
            continue
        base = views.get(id(node.operand(0)))
        if base is None:
            continue
        labels = _axes.follow(node, base.labels)
        if labels is not None:
            views[id(node.outs[0])] = _View(base.index, labels, base.nodes + (node,))
    return views


def _reaching_losses(program: Program) -> frozenset[int]:
    # Repeated until nothing is added: a scan body's `loop` link (see
    # `_program.symbolic`) feeds the body's carry back to its start.
    reach: set[int] = set()
    size = -1
    while size != len(reach):
        size = len(reach)
        for node in reversed(program.nodes):
            if node.eqn.primitive is loss_tag_p:
                reach.add(id(node.operand(0)))
            elif any(o is not None and id(o) in reach for o in node.outs):
                reach.update(id(a) for a in node.args)
    return frozenset(reach)


@dataclasses.dataclass(frozen=True, eq=False)
class _Graph:
    """What every phase reads: the program, its parameters and their views."""

    program: Program
    num_leaves: int
    leaf_paths: tuple[str, ...]
    paths: tuple[str, ...]  # of every parameter index (leaves, then units)
    srcvars: tuple[PVar, ...]
    shapes: tuple[tuple[int, ...], ...]
    views: Mapping[int, _View]
    consumers: Mapping[int, list[Node]]
    reach: frozenset[int]  # ids of the variables a registered loss depends on

    @classmethod
    def of(cls, program: Program, leaf_paths: Sequence[str]) -> "_Graph":
        srcvars = tuple(sources(program, len(leaf_paths)))
        return cls(
            program=program,
            num_leaves=len(leaf_paths),
            leaf_paths=tuple(leaf_paths),
            paths=tuple(unit_paths(program, leaf_paths)),
            srcvars=srcvars,
            shapes=tuple(tuple(v.aval.shape) for v in srcvars),
            views=types.MappingProxyType(_views(program, srcvars)),
            consumers=types.MappingProxyType(program.consumers()),
            reach=_reaching_losses(program),
        )

    def reaches_loss(self, node: Node) -> bool:
        return any(o is not None and id(o) in self.reach for o in node.outs)

    def model_order(self, index: int) -> tuple[int, tuple[int, ...]]:
        """Sort key of a parameter: a scan unit sorts with its leaf, by step."""
        if index < self.num_leaves:
            return (index, ())
        unit = self.program.units[index - self.num_leaves]
        return (unit.leaf, unit.index)

    def lineage(self, index: int) -> list[PVar]:
        """The variable of a parameter and of every coarser slice it was cut from."""
        out = [self.srcvars[index]]
        parents = {id(u.var): u.parent for u in self.program.units}
        while id(out[-1]) in parents:
            out.append(parents[id(out[-1])])
        return out


# ---------------------------------------------------------------------------
# Phase 2: candidates, one per layer-shaped equation.


@dataclasses.dataclass(frozen=True, eq=False)
class _Candidate:
    kind: LayerKind
    core: Node
    weight: _View | None
    bias: _View | None
    activation: Any
    in_order: tuple[int, ...]
    d_in: int
    weight_perm: tuple[int, ...] | None
    outputs: PVar  # the variable perturbed: the core's output, or after its bias
    out_labels: tuple[OutputLabel, ...]
    chain: tuple[Node, ...] = ()  # the equations from the core to `outputs`
    # For a declared layer: the equations computing it from its parameters.
    computes: frozenset[int] = frozenset()

    @property
    def param_views(self) -> tuple[_View, ...]:
        return tuple(v for v in (self.weight, self.bias) if v is not None)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(v.index for v in self.param_views)

    @property
    def declared(self) -> bool:
        return self.core.eqn.primitive is layer_tag_p


def _full_perm(view: _View, axes: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """Leaf axes in the order of view axes `axes`, if that is a permutation."""
    perm = tuple(view.labels[a] for a in axes)
    if None in perm or sorted(perm) != list(range(rank)):  # pyright: ignore
        return None
    return perm  # pyright: ignore


def _shape(atom) -> tuple[int, ...]:
    if isinstance(atom, Const):
        return tuple(getattr(atom.value, "shape", ()))
    return tuple(atom.aval.shape)


def _param_and_activation(graph: _Graph, p_atom, x_atom) -> _View | None:
    """The view of `p_atom` when it is a parameter and `x_atom` is not."""
    if id(p_atom) not in graph.views or id(x_atom) in graph.views:
        return None
    return graph.views[id(p_atom)]


def _dense(node: Node, graph: _Graph) -> _Candidate | None:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
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
            "dense", node, view, x_atom, labels, in_order, perm, d_in
        )
    return None


def _core_candidate(kind, node, view, x_atom, labels, in_order, perm, d_in):
    return _Candidate(
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


def _conv(node: Node, graph: _Graph) -> _Candidate | None:
    lhs, rhs = node.operand(0), node.operand(1)
    view = _param_and_activation(graph, rhs, lhs)
    # Grouped convolutions are block-diagonal in the channels: no one Kronecker
    # factor pair fits them, so they stay unmatched (diagonal).
    if view is None or node.params["batch_group_count"] != 1:
        return None
    dn = node.params["dimension_numbers"]
    rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
    perm = _full_perm(view, rhs_spec, len(graph.shapes[view.index]))
    if perm is None:
        return None
    labels = output_labels(len(out_spec), (out_spec[1],))
    k_shape = _shape(rhs)
    d_in = math.prod(k_shape[a] for a in rhs_spec[1:])
    return _core_candidate("conv", node, view, lhs, labels, (), perm, d_in)


def _elementwise(node: Node, graph: _Graph) -> _Candidate | None:
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
        return _Candidate(
            kind="scale_and_shift",
            core=node,
            weight=view if is_scale else None,
            bias=None if is_scale else view,
            activation=x_atom,
            in_order=_axes.location_axes(labels) + feat_axes,
            d_in=math.prod(graph.shapes[view.index]),
            weight_perm=None,
            outputs=node.outs[0],
            out_labels=labels,
        )
    return None


def _scale_features(view: _View, p_shape, leaf_shape) -> tuple[int, ...] | None:
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
    if leaf_axes != sorted(leaf_axes):  # pyright: ignore
        return None
    if math.prod(p_shape[ax] for ax in feat_axes) != leaf_size:
        return None
    return feat_axes


def _embedding(node: Node, graph: _Graph) -> _Candidate | None:
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
    dn = node.params["dimension_numbers"]
    out_rank = len(node.eqn.outvars[0].aval.shape)
    row = dn.offset_dims[0] if dn.collapsed_slice_dims == () else None  # size 1
    labels = output_labels(
        out_rank, (dn.offset_dims[-1],), () if row is None else (row,)
    )
    start_map = tuple(dn.start_index_map)
    return _core_candidate(
        "embedding", node, view, indices, labels, (start_map.index(0),), perm,
        _shape(table)[0],
    )  # fmt: skip


def _gathers_rows(node: Node, t_shape, i_shape) -> bool:
    dn, sizes = node.params["dimension_numbers"], tuple(node.params["slice_sizes"])
    start_map = tuple(dn.start_index_map)
    return (
        len(t_shape) == 2
        and 0 in start_map
        and all(d == 0 or t_shape[d] == sizes[d] for d in start_map)
        and tuple(dn.collapsed_slice_dims) in ((), (0,))
        and tuple(getattr(dn, "operand_batching_dims", ())) == ()
        and sizes == (1, t_shape[1])
        and i_shape[-1:] == (len(start_map),)
    )


def _declared(node: Node, graph: _Graph) -> _Candidate | None:
    """A dense layer tagged with `eqfisher.register_dense`: `y = x @ w (+ b)`."""
    if node.params["groups"]:
        return None  # not cut into one layer per group: no parameter slices
    y, x, w = node.operand(0), node.operand(1), node.operand(2)
    view = _param_and_activation(graph, w, x)
    if view is None:
        return None
    perm = _full_perm(view, (1, 0), len(graph.shapes[view.index]))
    bias = _declared_bias(node, graph, view)
    if perm is None or bias is False:
        return None
    y_rank, x_rank = len(_shape(y)), len(_shape(x))
    declared = _Candidate(
        kind="dense",
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
    return dataclasses.replace(declared, computes=_computing(graph, declared, y))


def _declared_bias(node: Node, graph: _Graph, weight: _View) -> _View | None | bool:
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


def _computing(graph: _Graph, cand: _Candidate, y) -> frozenset[int]:
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


_CORE_MATCHERS: Mapping[str, Callable[[Node, _Graph], _Candidate | None]] = (
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


def _with_bias(cand: _Candidate, graph: _Graph) -> _Candidate:
    """Follows the core output through relayouts to an `add` of a parameter."""
    if cand.declared:
        return cand
    var, labels, chain = cand.outputs, cand.out_labels, ()
    while len(users := graph.consumers.get(id(var), [])) == 1:
        (user,) = users
        if user.name == "add" and cand.kind != "embedding":
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
        new = _axes.follow(user, labels)
        if new is None or {lab for lab in new if lab} != {lab for lab in labels if lab}:
            return cand
        var, labels, chain = user.outs[0], new, chain + (user,)
    return cand


def _bias_of(cand: _Candidate, add: Node, var, labels, graph: _Graph) -> _View | None:
    other = [a for a in add.operands if a is not var]
    if len(other) != 1 or id(other[0]) not in graph.views:
        return None
    bview = graph.views[id(other[0])]
    if cand.weight is not None and bview.index == cand.weight.index:
        return None
    if not _bias_fits(bview, _shape(other[0]), labels, _shape(var)):
        return None
    return bview


def _bias_fits(bview: _View, b_shape, labels, out_shape) -> bool:
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


def _candidates(graph: _Graph) -> tuple[_Candidate, ...]:
    """Every layer-shaped equation, then the shift-only layers (an `add` of a
    parameter nobody took as a bias). A declared layer's parameters are its own:
    equations that also match inside its computation are no layers."""
    cores = []
    for node in graph.program.nodes:
        match = _CORE_MATCHERS.get(node.name)
        if match is not None and (cand := match(node, graph)) is not None:
            cores.append(_with_bias(cand, graph))
    taken = {id(c.chain[-1]) for c in cores if c.chain}
    shifts = [
        cand
        for node in graph.program.nodes
        if node.name == "add" and id(node) not in taken
        if (cand := _elementwise(node, graph)) is not None
    ]
    declared = {i for c in cores if c.declared for i in c.indices}
    return tuple(
        c for c in cores + shifts if c.declared or not declared.intersection(c.indices)
    )


# ---------------------------------------------------------------------------
# Phase 3: which candidates stay, and why the others do not.


class _Verdict(NamedTuple):
    dropped: frozenset[int]  # ids of dropped candidates
    reasons: Mapping[int, str]  # parameter index -> why it is in no layer

    def drop(self, cands, reasons: Mapping[int, str]) -> "_Verdict":
        """Also drops `cands`; `reasons` replace earlier ones."""
        return _Verdict(
            self.dropped | {id(c) for c in cands},
            types.MappingProxyType({**self.reasons, **reasons}),
        )


def _ties(cands: Sequence[_Candidate]) -> tuple[Mapping[int, tuple], _Verdict]:
    """Groups the applications of tied weights; drops the layers whose weights are
    shared between different layouts."""
    claims: dict[int, list[_Candidate]] = {}
    for cand in cands:
        for index in cand.indices:
            claims.setdefault(index, []).append(cand)
    tied, verdict = {}, _Verdict(frozenset(), types.MappingProxyType({}))
    for index, users in claims.items():
        if len(users) == 1:
            continue
        if _tie_compatible(users):
            tied.update({id(c): tuple(users) for c in users})
            continue
        reason = (
            f"used by {len(users)} layers of different layouts (shared or tied weights)"
        )
        verdict = verdict.drop(users, {index: reason})
    return tied, verdict


def _tie_compatible(users: Sequence[_Candidate]) -> bool:
    """Whether several applications of one weight can share a Kronecker block."""

    def key(c: _Candidate):
        return (
            c.kind,
            None if c.weight is None else c.weight.index,
            None if c.bias is None else c.bias.index,
            c.weight_perm,
            c.d_in,
            len(_axes.feature_axes(c.out_labels)),
        )

    first = key(users[0])
    return first[0] in ("dense", "conv") and all(key(c) == first for c in users)


def _outside_uses(cands, tied, graph: _Graph, verdict: _Verdict) -> _Verdict:
    """Drops the layers whose parameters are also read outside every use of the
    layer, on a path to a loss: their Kronecker statistics would miss that use."""
    for cand in cands:
        if id(cand) in verdict.dropped:
            continue
        own = _own_nodes(tied.get(id(cand), (cand,)))
        for view in cand.param_views:
            srcs = [graph.srcvars[view.index]] + [n.outs[0] for n in view.nodes]
            users = [u for s in srcs for u in graph.consumers.get(id(s), [])]
            outside = [u for u in users if id(u) not in own and graph.reaches_loss(u)]
            if outside:
                reason = (
                    f"also used outside its {cand.kind} layer (by `{outside[-1].name}`)"
                )
                verdict = verdict.drop([cand], {view.index: reason})
    return verdict


def _own_nodes(uses: Sequence[_Candidate]) -> set[int]:
    own = set()
    for use in uses:
        for view in use.param_views:
            own.update(id(n) for n in view.nodes)
        own.update(id(n) for n in (use.core,) + use.chain)
        own.update(use.computes)
    return own


def _stack_uses(cands, graph: _Graph, verdict: _Verdict) -> _Verdict:
    """Drops the layers of scan units whose stacked leaf is also read another way:
    their Kronecker statistics would miss that use."""
    cutters: dict[int, set[int]] = {}  # parent var -> its units' slicing equations
    for u in graph.program.units:
        cutters.setdefault(id(u.parent), set()).update(id(n) for n in u.nodes)
    for j, u in enumerate(graph.program.units):
        k = graph.num_leaves + j
        claimants = [c for c in cands if k in c.indices]
        allowed = cutters[id(u.parent)].union(*(c.computes for c in claimants))
        others = [
            n
            for n in graph.consumers.get(id(u.parent), [])
            if id(n) not in allowed and graph.reaches_loss(n)
        ]
        if others:
            reason = f"its stacked leaf is also used outside the scan (by `{others[0].name}`)"
            verdict = verdict.drop(claimants, {k: reason})
    return verdict


def _partner_reasons(cands, graph: _Graph, verdict: _Verdict) -> _Verdict:
    """The other parameters of a dropped layer say why it was dropped."""
    reasons = dict(verdict.reasons)
    for cand in cands:
        if id(cand) not in verdict.dropped:
            continue
        for index in cand.indices:
            others = [i for i in cand.indices if i in reasons]
            if index not in reasons and others:
                reasons[index] = (
                    f"in a {cand.kind} layer with `{graph.paths[others[0]]}`, which "
                    "is unmatched"
                )
    return verdict.drop([], reasons)


def _judge(cands: Sequence[_Candidate], graph: _Graph) -> _Verdict:
    tied, verdict = _ties(cands)
    verdict = _outside_uses(cands, tied, graph, verdict)
    verdict = _stack_uses(cands, graph, verdict)
    return _partner_reasons(cands, graph, verdict)


# ---------------------------------------------------------------------------
# Phase 4: records and reasons.


class _Numbering(NamedTuple):
    """Parameter numbers as the records use them: paths and model order."""

    num_leaves: int
    leaf_paths: tuple[str, ...]
    paths: tuple[str, ...]
    orders: tuple[tuple[int, tuple[int, ...]], ...]  # (leaf, index) of each number


def _numbering(program: Program, leaf_paths: Sequence[str]) -> _Numbering:
    orders = [(i, ()) for i in range(len(leaf_paths))]
    orders += [(u.leaf, u.index) for u in program.units]
    return _Numbering(
        len(leaf_paths),
        tuple(leaf_paths),
        tuple(unit_paths(program, leaf_paths)),
        tuple(orders),
    )


def _record(
    cand: _Candidate,
    numbering: _Numbering,
    indices: tuple[int, ...] | None = None,
    inputs: Any = None,
    outputs: PVar | None = None,
) -> LayerRecord:
    """The record of a kept candidate; a scan body's candidate at one step gives
    that step's `indices`, `inputs` and `outputs`."""
    indices = cand.indices if indices is None else indices
    paths = tuple(numbering.paths[i] for i in indices)
    name = layer_name(paths)
    steps = {
        numbering.orders[i][1] if i >= numbering.num_leaves else None for i in indices
    }
    if len(steps) == 1 and (step := steps.pop()) is not None:
        # One scan step's slices: the step index comes last, `blocks.attn.q[2]`.
        base = [numbering.leaf_paths[numbering.orders[i][0]] for i in indices]
        name = layer_name(base) + "".join(f"[{k}]" for k in step)
    out_shape = cand.outputs.aval.shape
    d_out = math.prod(out_shape[i] for i in _axes.feature_axes(cand.out_labels))
    return LayerRecord(
        info=LayerInfo(name, cand.kind, paths),
        param_indices=indices,
        inputs=cand.activation if inputs is None else inputs,
        outputs=cand.outputs if outputs is None else outputs,
        in_order=cand.in_order,
        out_order=_axes.matrix_order(cand.out_labels),
        d_in=cand.d_in,
        d_out=d_out,
        weight_perm=cand.weight_perm,
        core=cand.core,
    )


def _kept(cands, verdict: _Verdict, graph: _Graph) -> list[_Candidate]:
    """The candidates that stay and reach a loss."""
    return [
        c
        for c in cands
        if id(c) not in verdict.dropped and id(c.outputs) in graph.reach
    ]


def _records(cands, verdict: _Verdict, graph: _Graph) -> tuple[LayerRecord, ...]:
    """The kept layers that reach a loss, in model order, with unique names."""
    numbering = _numbering(graph.program, graph.leaf_paths)
    records = [_record(c, numbering) for c in _kept(cands, verdict, graph)]
    return _in_order(records, numbering)


def _in_order(records, numbering: _Numbering) -> tuple[LayerRecord, ...]:
    records = sorted(
        records, key=lambda r: min(numbering.orders[i] for i in r.param_indices)
    )
    return _unique_names(records)


def _unique_names(records: Sequence[LayerRecord]) -> tuple[LayerRecord, ...]:
    seen: dict[str, int] = {}
    owners: dict[str, tuple[int, ...]] = {}
    out = []
    for r in records:
        name = r.info.name
        if owners.get(name) == r.param_indices:  # another use of a tied layer
            out.append(r)
            continue
        owners.setdefault(name, r.param_indices)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
            r = dataclasses.replace(r, info=LayerInfo(name, r.kind, r.info.param_paths))
        out.append(r)
    return tuple(out)


_CONTROL_FLOW = frozenset({"scan", "cond", "while"})


def _unmatched(
    records: Sequence[LayerRecord], verdict: _Verdict, graph: _Graph
) -> tuple[tuple[str, str], ...]:
    used = {i for r in records for i in r.param_indices}
    split = graph.program.stacked()
    out = []
    for i in sorted(range(len(graph.paths)), key=graph.model_order):
        if i in used or id(graph.srcvars[i]) in split:  # stacked: see its units
            continue
        out.append((graph.paths[i], _reason(i, verdict, graph)))
    return tuple(out)


def _reason(index: int, verdict: _Verdict, graph: _Graph) -> str:
    if index in verdict.reasons:
        return verdict.reasons[index]
    if id(graph.srcvars[index]) not in graph.reach:
        return "does not affect any registered loss"
    control = _control_flow_user(graph, index)
    if control == "scan":
        return (
            "used inside `scan`; scans longer than "
            f"{current_config().max_unroll} steps are not unrolled"
        )
    if control is not None:
        return (
            f"used inside `{control}`; layers inside control flow are not detected yet"
        )
    return "no layer pattern"


def _control_flow_user(graph: _Graph, index: int) -> str | None:
    """The control-flow primitive a parameter (or a view of it) feeds, if any."""
    srcs = [graph.srcvars[index]] + [
        n.outs[0]
        for n in graph.program.nodes
        if n.outs
        and id(n.outs[0]) in graph.views
        and graph.views[id(n.outs[0])].index == index
    ]
    for src in srcs:
        for user in graph.consumers.get(id(src), []):
            if user.name in _CONTROL_FLOW:
                return user.name
    return None


def detect(program: Program, leaf_paths: Sequence[str]) -> Detection:
    """Finds the layers of `program`, whose first invars are the parameter leaves.

    Parameters are numbered as in `sources`: leaves, then scan units. The layers of
    a kept scan (`_program.ScanNode`) are found once, on its body with symbolic
    units (`_program.symbolic`), and given one record per step.
    """
    seen = symbolic(program)
    graph = _Graph.of(seen, leaf_paths)
    cands = _candidates(graph)
    verdict = _judge(cands, graph)
    if seen is program:
        records = _records(cands, verdict, graph)
        return Detection(records, _unmatched(records, verdict, graph))
    return _every_step(program, graph, cands, verdict)


def _every_step(program: Program, graph: _Graph, cands, verdict: _Verdict) -> Detection:
    """Records and reasons of `program` from the detection on its symbolic
    program (`graph`): a candidate in a scan body gives one record per step, a
    symbolic unit's reason holds for each step's unit."""
    numbering = _numbering(program, graph.leaf_paths)
    number = {id(u): graph.num_leaves + j for j, u in enumerate(program.units)}
    # Symbolic number -> the real numbers per step; other numbers stay.
    per_step: dict[int, dict[int, int]] = {}
    moved: dict[int, int] = {i: i for i in range(graph.num_leaves)}
    scans = scan_nodes(program)
    owner: dict[int, ScanNode] = {}
    for scan in scans:
        for u in scan.units:
            owner[id(u)] = scan
    for j, u in enumerate(graph.program.units):
        k = graph.num_leaves + j
        scan = next((sc for sc in scans if any(s is u for s in sc.symbolic)), None)
        if scan is None:
            moved[k] = number[id(u)]
            continue
        per_step[k] = {
            r.index[0]: number[id(r)] for r in scan.units if r.leaf == u.leaf
        }
    body_of = {id(n): scan for scan in scans for n in scan.body}
    records = []
    for cand in _kept(cands, verdict, graph):
        scan = body_of.get(id(cand.core))
        if scan is None:
            records.append(
                _record(cand, numbering, tuple(moved[i] for i in cand.indices))
            )
            continue
        inside = scan.body_vars()

        def at(var, step, scan=scan, inside=inside):
            return scan.step_var(var, step) if id(var) in inside else var

        for step in scan.steps:
            indices = tuple(
                per_step[i][step] if i in per_step else moved[i] for i in cand.indices
            )
            records.append(
                _record(
                    cand,
                    numbering,
                    indices,
                    at(cand.activation, step),
                    at(cand.outputs, step),
                )
            )
    records = _in_order(records, numbering)
    used = {i for r in records for i in r.param_indices}
    back = {v: k for k, v in moved.items()}
    for k, steps in per_step.items():
        back.update({v: k for v in steps.values()})
    split = program.stacked()
    srcvars = sources(program, graph.num_leaves)
    unmatched = []
    for i in sorted(range(len(numbering.paths)), key=lambda i: numbering.orders[i]):
        if i in used or id(srcvars[i]) in split:
            continue
        k = back[i]
        reason = _reason(k, verdict, graph)
        if k in per_step:
            step = numbering.orders[i][1][0]
            reason = reason.replace(f"[{SYMBOLIC}]", f"[{step}]")
        unmatched.append((numbering.paths[i], reason))
    return Detection(records, tuple(unmatched))


def layer_name(paths: Sequence[str]) -> str:
    parts = [_split(p) for p in paths]
    common = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    if len(paths) == 1 and len(parts[0]) > 1:
        common = parts[0][:-1]
    if not common:
        return "+".join(p.lstrip(".") for p in paths)
    return "".join(common).lstrip(".")


def _split(path: str) -> list[str]:
    out, cur = [], ""
    for ch in path:
        if ch in ".[" and cur:
            out.append(cur)
            cur = ""
        cur += ch
    if cur:
        out.append(cur)
    return out
