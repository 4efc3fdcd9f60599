"""Layer kinds and their detection on a flattened jaxpr.

Detection works on equations, not on module types, so `eqx.nn.Linear` under
`jax.vmap`, a raw `x @ w + b`, an `einsum` and an attention projection are all the
same thing to it: a `dot_general` with a parameter on one side, perhaps followed by a
bias added along the output features.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx

from . import _axes, _program
from ._program import STRUCTURAL, Const, Node, Program, PVar
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
    `weight_perm` maps the weight leaf to its `(d_out, d_in)` matrix view.
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
    bias_shape: tuple[int, ...] | None
    core: Node
    nodes: tuple[Node, ...]

    @property
    def kind(self) -> LayerKind:
        return self.info.kind

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None


@dataclasses.dataclass
class _View:
    index: int  # which parameter leaf
    labels: tuple[Any, ...]  # each axis: the leaf axis it comes from, or None
    nodes: tuple[Node, ...]  # the structural equations between the leaf and here


@dataclasses.dataclass
class _Candidate:
    kind: LayerKind
    core: Node
    weight: _View | None
    activation: Any
    core_labels: tuple[Any, ...]  # core output axis -> ("loc", k) | ("feat", k)
    in_order: tuple[int, ...]
    d_in: int
    weight_perm: tuple[int, ...] | None
    bias: _View | None = None
    outputs: Any = None
    out_labels: tuple[Any, ...] = ()
    chain: tuple[Node, ...] = ()


def sources(program: Program, num_params: int) -> list[PVar]:
    """The variable of each parameter index: the leaves, then the scan units."""
    return list(program.invars[:num_params]) + [u.var for u in program.units]


def _views(program: Program, num_params: int) -> dict[int, _View]:
    views: dict[int, _View] = {}
    for i, v in enumerate(sources(program, num_params)):
        views[id(v)] = _View(i, tuple(range(len(v.aval.shape))), ())
    for node in program.nodes:
        if node.name not in STRUCTURAL or not node.args:
            continue
        src = node.operand(0)
        if id(src) not in views:
            continue
        base = views[id(src)]
        labels = _axes.follow(node, base.labels)
        if labels is not None:
            views[id(node.outs[0])] = _View(base.index, labels, base.nodes + (node,))
    return views


def _full_perm(view: _View, axes: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """Leaf axes in the order of view axes `axes`, if that is a permutation."""
    perm = tuple(view.labels[a] for a in axes)
    if None in perm or sorted(perm) != list(range(rank)):
        return None
    return perm


def _shape(atom) -> tuple[int, ...]:
    if isinstance(atom, Const):
        return tuple(getattr(atom.value, "shape", ()))
    return tuple(atom.aval.shape)


def _dense(node: Node, views, shapes) -> _Candidate | None:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.operand(0), node.operand(1)
    for w_atom, x_atom, wc, xc, wb, w_is_lhs in (
        (lhs, rhs, lc, rc, lb, True),
        (rhs, lhs, rc, lc, rb, False),
    ):
        if id(w_atom) not in views or id(x_atom) in views or wb:
            continue
        view = views[id(w_atom)]
        w_rank, x_rank = len(_shape(w_atom)), len(_shape(x_atom))
        w_free = [a for a in range(w_rank) if a not in wc]
        x_free = [a for a in range(x_rank) if a not in xc]
        perm = _full_perm(view, w_free + list(wc), len(shapes[view.index]))
        if perm is None:
            continue
        n_w, n_x = len(w_free), len(x_free)
        feats = [("feat", k) for k in range(n_w)]
        locs = [("loc", k) for k in range(n_x)]
        labels = tuple(feats + locs if w_is_lhs else locs + feats)
        x_shape = _shape(x_atom)
        return _Candidate(
            kind="dense",
            core=node,
            weight=view,
            activation=x_atom,
            core_labels=labels,
            in_order=tuple(x_free) + tuple(xc),
            d_in=math.prod(x_shape[a] for a in xc),
            weight_perm=perm,
        )
    return None


def _conv(node: Node, views, shapes) -> _Candidate | None:
    lhs, rhs = node.operand(0), node.operand(1)
    if id(rhs) not in views or id(lhs) in views:
        return None
    # Grouped convolutions are block-diagonal in the channels: no one Kronecker
    # factor pair fits them, so they stay unmatched (diagonal).
    if node.params["batch_group_count"] != 1:
        return None
    dn = node.params["dimension_numbers"]
    view = views[id(rhs)]
    rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
    perm = _full_perm(view, rhs_spec, len(shapes[view.index]))
    if perm is None:
        return None
    rank = len(out_spec)
    labels = [None] * rank
    loc = 0
    for axis in range(rank):
        if axis == out_spec[1]:
            labels[axis] = ("feat", 0)
        else:
            labels[axis] = ("loc", loc)
            loc += 1
    k_shape = _shape(rhs)
    d_in = math.prod(k_shape[a] for a in rhs_spec[1:])
    return _Candidate(
        kind="conv",
        core=node,
        weight=view,
        activation=lhs,
        core_labels=tuple(labels),
        in_order=(),
        d_in=d_in,
        weight_perm=perm,
    )


def _elementwise(node: Node, views, shapes) -> _Candidate | None:
    """`x * scale` (or `x + shift`) with a parameter broadcast along locations."""
    a, b = node.operand(0), node.operand(1)
    out_shape = tuple(node.eqn.outvars[0].aval.shape)
    for p_atom, x_atom in ((a, b), (b, a)):
        if id(p_atom) not in views or id(x_atom) in views or isinstance(x_atom, Const):
            continue
        view = views[id(p_atom)]
        p_shape = _shape(p_atom)
        if _shape(x_atom) != out_shape or len(p_shape) != len(out_shape):
            continue
        leaf_size = math.prod(shapes[view.index])
        if len(shapes[view.index]) == 0 or leaf_size <= 1:
            continue  # a scalar (temperature, ...) is no layer
        # Feature axes are those the leaf varies along; an axis with no leaf origin
        # was created by broadcasting (GroupNorm broadcasts its weight to the full
        # shape), so the parameter is constant along it: a location.
        feat_axes = [
            ax for ax, n in enumerate(p_shape) if view.labels[ax] is not None and n != 1
        ]
        leaf_axes = [view.labels[ax] for ax in feat_axes]
        if leaf_axes != sorted(leaf_axes):
            continue
        if math.prod(p_shape[ax] for ax in feat_axes) != leaf_size:
            continue
        labels, f, loc = [], 0, 0
        for ax in range(len(out_shape)):
            if ax in feat_axes:
                labels.append(("feat", f))
                f += 1
            else:
                labels.append(("loc", loc))
                loc += 1
        kind_node = node if node.name == "mul" else None
        return _Candidate(
            kind="scale_and_shift",
            core=node,
            weight=view if kind_node is not None else None,
            activation=x_atom,
            core_labels=tuple(labels),
            in_order=tuple(i for i, lab in enumerate(labels) if lab[0] == "loc")
            + tuple(feat_axes),
            d_in=leaf_size,
            weight_perm=None,
            bias=None if kind_node is not None else view,
        )
    return None


def _embedding(node: Node, views, shapes) -> _Candidate | None:
    """A gather of whole rows of a `(vocab, features)` table.

    `table[ids]` gathers with the row index alone; `jax.vmap` of
    `eqx.nn.Embedding` gathers `(1, features)` slices at `(row, 0)` and squeezes the
    row axis. Both are accepted: the row must be indexed, every other indexed axis
    sliced whole (so its start index is 0).
    """
    table, indices = node.operand(0), node.operand(1)
    if id(table) not in views or id(indices) in views:
        return None
    dn = node.params["dimension_numbers"]
    view = views[id(table)]
    t_shape = _shape(table)
    start_map = tuple(dn.start_index_map)
    collapsed = tuple(dn.collapsed_slice_dims)
    if (
        len(t_shape) != 2
        or 0 not in start_map
        or any(
            d != 0 and t_shape[d] != node.params["slice_sizes"][d] for d in start_map
        )
        or collapsed not in ((), (0,))
        or tuple(getattr(dn, "operand_batching_dims", ())) != ()
        or tuple(node.params["slice_sizes"]) != (1, t_shape[1])
        or _shape(indices)[-1:] != (len(start_map),)
    ):
        return None
    perm = _full_perm(view, (1, 0), 2)
    if perm is None:
        return None
    out_rank = len(node.eqn.outvars[0].aval.shape)
    feat = dn.offset_dims[-1]
    row = dn.offset_dims[0] if not collapsed else None  # a size-1 axis
    labels: list[Any] = []
    loc = 0
    for ax in range(out_rank):
        if ax == feat:
            labels.append(("feat", 0))
        elif ax == row:
            labels.append(None)
        else:
            labels.append(("loc", loc))
            loc += 1
    return _Candidate(
        kind="embedding",
        core=node,
        weight=view,
        activation=indices,
        core_labels=tuple(labels),
        in_order=(start_map.index(0),),
        d_in=t_shape[0],
        weight_perm=perm,
    )


_MATCHERS = {
    "dot_general": _dense,
    "conv_general_dilated": _conv,
    "mul": _elementwise,
    "add": _elementwise,
    "gather": _embedding,
}


def _attach_bias(cand: _Candidate, views, consumers) -> None:
    """Follows the core output through relayouts to an `add` of a parameter."""
    var, labels, chain = cand.core.outs[0], cand.core_labels, ()
    cand.outputs, cand.out_labels = var, labels
    while True:
        users = consumers.get(id(var), [])
        if len(users) != 1:
            return
        (user,) = users
        if user.name == "add" and cand.kind != "embedding":
            other = [a for a in user.operands if a is not var]
            if len(other) != 1 or id(other[0]) not in views:
                return
            bview = views[id(other[0])]
            if cand.weight is not None and bview.index == cand.weight.index:
                return
            if _bias_fits(bview, _shape(other[0]), labels, _shape(var)):
                cand.bias = bview
                cand.chain = chain + (user,)
                cand.outputs, cand.out_labels = user.outs[0], labels
            return
        if user.name not in STRUCTURAL or user.operand(0) is not var:
            return
        new = _axes.follow(user, labels)
        if new is None or {lab for lab in new if lab} != {lab for lab in labels if lab}:
            return
        var, labels, chain = user.outs[0], new, chain + (user,)


def _bias_fits(bview: _View, b_shape, labels, out_shape) -> bool:
    if len(b_shape) != len(out_shape):
        return False
    feats = []
    for p, (nb, no) in enumerate(zip(b_shape, out_shape, strict=False)):
        is_feat = labels[p] is not None and labels[p][0] == "feat"
        if not is_feat:
            # Constant along locations: size 1, or broadcast (no leaf origin).
            if nb != 1 and bview.labels[p] is not None:
                return False
            continue
        if nb != no:
            return False
        if nb != 1:
            if bview.labels[p] is None:
                return False
            feats.append((bview.labels[p], labels[p][1]))
    feats.sort()
    return [f for _, f in feats] == sorted(f for _, f in feats)


def _tie_compatible(users: list[_Candidate]) -> bool:
    """Whether several applications of one weight can share a Kronecker block."""

    def key(c: _Candidate):
        return (
            c.kind,
            None if c.weight is None else c.weight.index,
            None if c.bias is None else c.bias.index,
            c.weight_perm,
            c.d_in,
            sum(1 for lab in c.core_labels if lab and lab[0] == "feat"),
        )

    first = key(users[0])
    return first[0] in ("dense", "conv") and all(key(c) == first for c in users)


def _reaching_losses(program: Program) -> set[int]:
    reach: set[int] = set()
    for node in reversed(program.nodes):
        if node.eqn.primitive is loss_tag_p:
            reach.add(id(node.operand(0)))
        elif any(o is not None and id(o) in reach for o in node.outs):
            reach.update(id(a) for a in node.args)
    return reach


def out_order(labels: Sequence[Any]) -> tuple[int, ...]:
    locs = sorted(
        (i for i, lab in enumerate(labels) if lab is None or lab[0] == "loc"),
        key=lambda i: (labels[i] is None, labels[i] and labels[i][1]),
    )
    feats = sorted(
        (i for i, lab in enumerate(labels) if lab is not None and lab[0] == "feat"),
        key=lambda i: labels[i][1],
    )
    return tuple(locs) + tuple(feats)


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


@dataclasses.dataclass(frozen=True)
class Detection:
    layers: tuple[LayerRecord, ...]
    unmatched: tuple[tuple[str, str], ...]  # (path, reason)


def unit_paths(program: Program, leaf_paths: Sequence[str]) -> list[str]:
    """The path of each parameter index: `.layers.weight`, `.layers.weight[2]`."""
    return list(leaf_paths) + [
        leaf_paths[u.leaf] + "".join(f"[{i}]" for i in u.index) for u in program.units
    ]


def detect(program: Program, leaf_paths: Sequence[str]) -> Detection:
    """Finds the layers of `program`, whose first invars are the parameter leaves.

    Parameters are numbered as in `sources`: leaves, then scan units.
    """
    num = len(leaf_paths)
    param_paths = unit_paths(program, leaf_paths)
    srcvars = sources(program, num)
    shapes = [tuple(v.aval.shape) for v in srcvars]
    views = _views(program, num)
    consumers = program.consumers()
    reach = _reaching_losses(program)

    cands: list[_Candidate] = []
    biases: set[int] = set()
    for node in program.nodes:
        match = _MATCHERS.get(node.name)
        if match is None or node.name == "add":
            continue
        cand = match(node, views, shapes)
        if cand is None:
            continue
        _attach_bias(cand, views, consumers)
        if cand.bias is not None:
            biases.add(id(cand.chain[-1]))
        cands.append(cand)
    for node in program.nodes:  # shift-only layers: an add nobody took as a bias
        if node.name == "add" and id(node) not in biases:
            cand = _elementwise(node, views, shapes)
            if cand is not None:
                cand.outputs, cand.out_labels = node.outs[0], cand.core_labels
                cands.append(cand)

    claims: dict[int, list[_Candidate]] = {}
    for cand in cands:
        for view in (cand.weight, cand.bias):
            if view is not None:
                claims.setdefault(view.index, []).append(cand)
    reasons: dict[int, str] = {}
    dropped: set[int] = set()
    tied: dict[int, list[_Candidate]] = {}  # id(candidate) -> all uses of its layer
    for index, users in claims.items():
        if len(users) > 1:
            if _tie_compatible(users):
                for c in users:
                    tied[id(c)] = users
                continue
            reasons[index] = (
                f"used by {len(users)} layers of different layouts (shared or tied "
                "weights)"
            )
            dropped.update(id(c) for c in users)
    for cand in cands:
        if id(cand) in dropped:
            continue
        own = set()
        for use in tied.get(id(cand), [cand]):
            for view in (use.weight, use.bias):
                if view is not None:
                    own.update(id(n) for n in view.nodes)
            own.update(id(n) for n in (use.core,) + use.chain)
        for view in (cand.weight, cand.bias):
            if view is None:
                continue
            srcs = [srcvars[view.index]] + [n.outs[0] for n in view.nodes]
            for src in srcs:
                for user in consumers.get(id(src), []):
                    if id(user) in own:
                        continue
                    if any(o is not None and id(o) in reach for o in user.outs):
                        reasons[view.index] = (
                            f"also used outside its {cand.kind} layer "
                            f"(by `{user.name}`)"
                        )
                        dropped.add(id(cand))

    _check_stacks(program, num, consumers, reach, cands, reasons, dropped)
    for cand in cands:  # the other leaves of a dropped layer say why
        if id(cand) not in dropped:
            continue
        leaves = [v.index for v in (cand.weight, cand.bias) if v is not None]
        for index in leaves:
            others = [i for i in leaves if i in reasons]
            if index not in reasons and others:
                reasons[index] = (
                    f"in a {cand.kind} layer with `{param_paths[others[0]]}`, which "
                    "is unmatched"
                )

    records = []
    for cand in cands:
        if id(cand) in dropped:
            continue
        if id(cand.outputs) not in reach:
            continue
        indices = tuple(v.index for v in (cand.weight, cand.bias) if v is not None)
        paths = tuple(param_paths[i] for i in indices)
        name = layer_name(paths)
        steps = {program.units[i - num].index if i >= num else None for i in indices}
        if len(steps) == 1 and (step := steps.pop()) is not None:
            # One scan step's slices: the step index comes last, `blocks.attn.q[2]`.
            base = [leaf_paths[program.units[i - num].leaf] for i in indices]
            name = layer_name(base) + "".join(f"[{k}]" for k in step)
        order = out_order(cand.out_labels)
        out_shape = cand.outputs.aval.shape
        d_out = math.prod(
            out_shape[i]
            for i in order
            if cand.out_labels[i] and cand.out_labels[i][0] == "feat"
        )
        nodes = (cand.core,) + cand.chain
        for view in (cand.weight, cand.bias):
            if view is not None:
                nodes = view.nodes + nodes
        records.append(
            LayerRecord(
                info=LayerInfo(name, cand.kind, paths),
                param_indices=indices,
                inputs=cand.activation,
                outputs=cand.outputs,
                in_order=cand.in_order,
                out_order=order,
                d_in=cand.d_in,
                d_out=d_out,
                weight_perm=cand.weight_perm,
                bias_shape=None
                if cand.bias is None or cand.weight is None
                else tuple(srcvars[cand.bias.index].aval.shape),
                core=cand.core,
                nodes=nodes,
            )
        )
    # Model order: a scan unit sorts with its leaf, by step.
    order = [(i, ()) for i in range(num)] + [(u.leaf, u.index) for u in program.units]
    records.sort(key=lambda r: min(order[i] for i in r.param_indices))
    records = _unique_names(records)
    used = {i for r in records for i in r.param_indices}
    split = program.stacked()
    unmatched = []
    for i in sorted(range(len(param_paths)), key=order.__getitem__):
        path = param_paths[i]
        if i in used or id(srcvars[i]) in split:  # a stacked leaf: see its units
            continue
        if i in reasons:
            reason = reasons[i]
        elif id(srcvars[i]) not in reach:
            reason = "does not affect any registered loss"
        elif control := _control_flow_user(srcvars, program, views, consumers, i):
            reason = f"used inside `{control}`; " + (
                f"scans longer than {_program.MAX_UNROLL} steps are not unrolled"
                if control == "scan"
                else "layers inside control flow are not detected yet"
            )
        else:
            reason = "no layer pattern"
        unmatched.append((path, reason))
    return Detection(tuple(records), tuple(unmatched))


_CONTROL_FLOW = frozenset({"scan", "cond", "while"})


def _check_stacks(program, num, consumers, reach, cands, reasons, dropped) -> None:
    """Drops the layers of scan units whose stacked leaf is also read another way:
    their Kronecker statistics would miss that use."""
    cutters: dict[int, set[int]] = {}  # parent var -> its units' slicing equations
    for u in program.units:
        cutters.setdefault(id(u.parent), set()).update(id(n) for n in u.nodes)
    index = {id(u.var): num + j for j, u in enumerate(program.units)}
    for u in program.units:
        others = [
            n
            for n in consumers.get(id(u.parent), [])
            if id(n) not in cutters[id(u.parent)]
            and any(o is not None and id(o) in reach for o in n.outs)
        ]
        if others:
            k = index[id(u.var)]
            reasons[k] = (
                "its stacked leaf is also used outside the scan "
                f"(by `{others[0].name}`)"
            )
            for c in cands:
                if any(v is not None and v.index == k for v in (c.weight, c.bias)):
                    dropped.add(id(c))


def _control_flow_user(srcvars, program, views, consumers, index: int) -> str | None:
    """The control-flow primitive a parameter (or a view of it) feeds, if any."""
    srcs = [srcvars[index]] + [
        n.outs[0]
        for n in program.nodes
        if n.outs and id(n.outs[0]) in views and views[id(n.outs[0])].index == index
    ]
    for src in srcs:
        for user in consumers.get(id(src), []):
            if user.name in _CONTROL_FLOW:
                return user.name
    return None


def _unique_names(records: list[LayerRecord]) -> list[LayerRecord]:
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
    return out
