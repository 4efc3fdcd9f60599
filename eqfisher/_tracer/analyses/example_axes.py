"""Where each program variable keeps its examples, found at trace time.

A variable's *label* is None when it depends on no example (parameters, shared
arrays, constants), an axis `e` when its slice `[e = n]` depends on example `n` and
on unlabelled variables only, and `MIXED` otherwise. The batch's arrays start with
the example axes `IndependentExamples(axis)` names; each equation maps its operands'
labels to its outputs' (`_RULES`), and an equation without a rule mixes whatever
labelled data it reads, so a rule can only make the analysis prove more.

When the registered losses' inputs are all labelled, the examples cannot interact
before the losses (no reduction, contraction, sort, scan or gather across examples),
and a scale-and-shift layer's per-example rows can be read from the main pass
without the forward per example that otherwise checks it (`_curvature/per_example.py`).
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from ... import _compat
from ...losses import loss_tag_p, loss_value_tag_p
from ..program import Const, Node, Program, ScanNode


MIXED = -1
Label = int | None


def join(a: Label, b: Label) -> Label:
    """The label of a variable that holds `a`'s data at one step, `b`'s at another."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    return MIXED


def program_labels(program: Program, input_labels: Sequence[Label]) -> dict[int, Label]:
    """The label of every variable of `program` (by id), the bodies of kept scans
    included; `input_labels` are its invars'."""
    env: dict[int, Label] = {id(v): a for v, a in zip(program.invars, input_labels)}
    _nodes(program.nodes, env)
    return env


def leaf_axes(axis: PyTree, batch: PyTree, caller: str) -> list[int | None]:
    """The example axis of each array leaf of `batch` (None: shared)."""

    class _Axis:
        def __init__(self, a):
            self.a = a

    try:
        whole = jax.tree_util.tree_map(
            lambda a, sub: jax.tree_util.tree_map(lambda _: _Axis(a), sub),
            axis,
            batch,
            is_leaf=lambda x: x is None,
        )
    except ValueError as e:
        raise ValueError(
            f"`{caller}(..., examples=IndependentExamples(axis=...))`: `axis` must "
            f"be an int or a PyTree prefix of `batch`: {e}"
        ) from None
    axes = [
        None if x.ndim == 0 else a.a
        for a, x in zip(
            jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(batch)
        )
        if eqx.is_array(x)
    ]
    return axes


def proven_labels(program: Program, s, batch, axis, caller: str) -> dict | None:
    """The labels of `program` (traced on the split `s` of a model and `batch`)
    when they prove that examples along `axis` do not interact before the
    registered losses (every loss's inputs labelled); None when they do not."""
    axes = leaf_axes(axis, batch, caller)
    inputs = [None] * (len(s.params) + len(s.others))
    inputs += [None if x.ndim == 0 else a for x, a in zip(s.batch, axes)]
    labels = program_labels(program, inputs)
    tags = [n for n in program.nodes if n.eqn.primitive is loss_tag_p]
    proven = all(_read(labels, n.operand(0)) not in (None, MIXED) for n in tags)
    return labels if proven else None


def stops_mixed_gradients(program: Program, s, batch, axis, caller: str) -> bool:
    """Whether a `stop_gradient` in `program` reads the data of several examples.

    A term such as `m - stop_gradient(m)` of a batch mean `m` (straight-through
    estimators, DiCE) is zero in value but not in derivative: examples then
    interact through derivatives alone, which the forward per example that checks
    independence sees only if it compares derivatives too (`per_example.probe`).
    """
    axes = leaf_axes(axis, batch, caller)
    inputs = [None] * (len(s.params) + len(s.others))
    inputs += [None if x.ndim == 0 else a for x, a in zip(s.batch, axes)]
    labels = program_labels(program, inputs)

    def stops(nodes) -> bool:
        for node in nodes:
            if isinstance(node, ScanNode) and stops(node.body):
                return True
            if node.eqn.primitive.name == "stop_gradient" and (
                _read(labels, node.operands[0]) == MIXED
            ):
                return True
        return False

    return stops(program.nodes)


def label_of(labels: dict, var) -> Label:
    """A variable's label; a scan step's (`StepVar`) is its body variable's."""
    return labels.get(id(getattr(var, "base", var)), MIXED)


def _read(env: dict[int, Label], atom) -> Label:
    return None if isinstance(atom, Const) else env.get(id(atom), MIXED)


def _nodes(nodes: Sequence[Node], env: dict[int, Label]) -> None:
    for node in nodes:
        if isinstance(node, ScanNode):
            outs = _kept_scan(node, env)
        else:
            outs = eqn_labels(node.eqn, [_read(env, a) for a in node.operands])
        for v, a in zip(node.outs, outs):
            if v is not None:
                env[id(v)] = a


def _kept_scan(node: ScanNode, env: dict[int, Label]) -> list[Label]:
    carry = [_read(env, a) for a in node.carry]
    xs = [_from_stacked(_read(env, a)) for a in node.xs]
    for v, a in zip(node.xs_in, xs):
        env[id(v)] = a
    n = len(carry)
    for _ in range(3):  # a carry's label settles within two passes
        for v, a in zip(node.carry_in, carry):
            env[id(v)] = a
        _nodes(node.body, env)
        out = [_read(env, a) for a in node.body_outs]
        new = [join(c, o) for c, o in zip(carry, out[:n])]
        if new == carry:
            return carry + [_to_stacked(a) for a in out[n:]]
        carry = new
    for v in node.carry_in + node.xs_in:  # unsettled: nothing in the body is known
        env[id(v)] = MIXED
    for inner in node.body:
        for v in inner.outs:
            if v is not None:
                env[id(v)] = MIXED
    return [MIXED] * len(node.outs)


def _from_stacked(a: Label) -> Label:
    """A scanned input's label in the body: scanning over examples mixes them."""
    if a is None or a == MIXED:
        return a
    return MIXED if a == 0 else a - 1


def _to_stacked(a: Label) -> Label:
    return a if a is None or a == MIXED else a + 1


def jaxpr_labels(jaxpr, consts_labels: Sequence[Label], labels: Sequence[Label]):
    """The labels of a jaxpr's outputs, from its constvars' and invars'."""
    env: dict[int, Label] = {}
    for v, a in zip(jaxpr.constvars, consts_labels):
        env[id(v)] = a
    for v, a in zip(jaxpr.invars, labels):
        env[id(v)] = a
    for eqn in jaxpr.eqns:
        ins = [
            None if _compat.is_literal(v) else env.get(id(v), MIXED) for v in eqn.invars
        ]
        for v, a in zip(eqn.outvars, eqn_labels(eqn, ins)):
            env[id(v)] = a
    return [
        None if _compat.is_literal(v) else env.get(id(v), MIXED) for v in jaxpr.outvars
    ]


def eqn_labels(eqn, labels: Sequence[Label]) -> list[Label]:
    """The labels of an equation's outputs from its operands'."""
    n_out = len(eqn.outvars)
    if all(a is None for a in labels):
        return [None] * n_out
    if MIXED in labels:
        return [MIXED] * n_out
    rule = _RULES.get(eqn.primitive.name)
    if rule is not None:
        # A rule returns one label for every output (or a list); axis numbers read
        # from equation parameters may be NumPy integers.
        out = rule(eqn, list(labels))
        out = out if isinstance(out, list) else [out] * n_out
        return [None if a is None else int(a) for a in out]
    body = _compat.call_body(eqn)
    if body is not None:
        return jaxpr_labels(body[0], [None] * len(body[1]), labels)
    if eqn.primitive.name == "scan":
        return _scan(eqn, list(labels))
    return [MIXED] * n_out


def _shape(v) -> tuple[int, ...]:
    return _compat.shape(v)


def _elementwise(eqn, labels) -> Any:
    """Operands of the output's shape, or broadcast to it along axes of size 1
    (scalars too): one label for all, on an axis no labelled operand broadcasts."""
    out = _shape(eqn.outvars[0])
    found = set()
    for v, a in zip(eqn.invars, labels):
        if a is None:
            continue
        shape = () if _compat.is_literal(v) else _shape(v)
        fits = len(shape) == len(out) and all(
            m in (n, 1) for m, n in zip(shape, out, strict=True)
        )
        if not fits or shape[a] != out[a]:
            return MIXED
        found.add(a)
    return found.pop() if len(found) == 1 else MIXED


_ELEMENTWISE = (
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp "
    "convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 "
    "expm1 floor ge gt imag integer_pow is_finite le lgamma digamma log log1p "
    "logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem "
    "round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor "
    "stop_gradient"
).split()


def _only(labels) -> int:
    """The one label of the labelled operands (`MIXED` if they disagree)."""
    found = {a for a in labels if a is not None}
    return found.pop() if len(found) == 1 else MIXED


def _broadcast_in_dim(eqn, labels) -> Any:
    return _compat.param(eqn, "broadcast_dimensions")[labels[0]]


def _reshape(eqn, labels) -> Any:
    if _compat.param(eqn, "dimensions", None) is not None:
        return MIXED
    e, old, new = labels[0], _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = math.prod(old[:e])
    for p in range(len(new)):
        if math.prod(new[:p]) == before and new[p] == old[e]:
            return p
    return MIXED


def _squeeze(eqn, labels) -> Any:
    dims = [d % len(_shape(eqn.invars[0])) for d in _compat.param(eqn, "dimensions")]
    e = labels[0]
    return MIXED if e in dims else e - sum(d < e for d in dims)


def _transpose(eqn, labels) -> Any:
    return list(_compat.param(eqn, "permutation")).index(labels[0])


def _reduce(eqn, labels) -> Any:
    axes = _compat.param(eqn, "axes")
    e = labels[0]
    return MIXED if e in axes else e - sum(d < e for d in axes)


def _along(key: str) -> Callable:
    """Equations that read along one axis (`key`): per example unless it is `e`."""

    def rule(eqn, labels):
        e = _only(labels)
        if e == MIXED:
            return MIXED
        axes = _compat.param(eqn, key)
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        return MIXED if e in axes else e

    return rule


def _dot_general(eqn, labels) -> Any:
    (lc, rc), (lb, rb) = _compat.param(eqn, "dimension_numbers")
    el, er = labels
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    l_free = [d for d in range(nl) if d not in lc and d not in lb]
    r_free = [d for d in range(nr) if d not in rc and d not in rb]
    if el is not None:
        if el in lb and (er is None or er == rb[list(lb).index(el)]):
            return list(lb).index(el)
        if el in l_free and er is None:
            return len(lb) + l_free.index(el)
        return MIXED
    if er in rb:
        return list(rb).index(er)
    if er in r_free:
        return len(lb) + len(l_free) + r_free.index(er)
    return MIXED


def _full_along(e: int, start, limit, shape, strides=None) -> bool:
    return (
        start[e] == 0 and limit[e] == shape[e] and (strides is None or strides[e] == 1)
    )


def _slice(eqn, labels) -> Any:
    e, p = labels[0], functools.partial(_compat.param, eqn)
    whole = _full_along(
        e, p("start_indices"), p("limit_indices"), _shape(eqn.invars[0]), p("strides")
    )
    return e if whole else MIXED


def _dynamic_slice(eqn, labels) -> Any:
    e = labels[0]
    if e is None or any(a is not None for a in labels[1:]):
        return MIXED
    return (
        e if _compat.param(eqn, "slice_sizes")[e] == _shape(eqn.invars[0])[e] else MIXED
    )


def _dynamic_update_slice(eqn, labels) -> Any:
    if any(a is not None for a in labels[2:]):
        return MIXED
    e = _only(labels[:2])
    if e == MIXED:
        return MIXED
    whole = _shape(eqn.invars[1])[e] == _shape(eqn.invars[0])[e]
    return e if whole else MIXED


def _pad(eqn, labels) -> Any:
    if labels[1] is not None:
        return MIXED
    e = labels[0]
    return e if tuple(_compat.param(eqn, "padding_config")[e]) == (0, 0, 0) else MIXED


def _conv(eqn, labels) -> Any:
    dn = _compat.param(eqn, "dimension_numbers")
    if labels[1] is not None or _compat.param(eqn, "batch_group_count") != 1:
        return MIXED
    return dn.out_spec[0] if labels[0] == dn.lhs_spec[0] else MIXED


def _gather(eqn, labels) -> Any:
    eo, ei = labels[0], labels[1]
    dn = _compat.param(eqn, "dimension_numbers")
    out_rank, n_idx = len(_shape(eqn.outvars[0])), len(_shape(eqn.invars[1]))
    batch = [d for d in range(out_rank) if d not in dn.offset_dims]
    if ei is not None and ei == n_idx - 1:
        return MIXED  # the index vector itself
    if eo is None:
        assert ei is not None  # `eqn_labels` calls a rule with some operand labelled
        return batch[ei]
    operand_batching, indices_batching = _compat.gather_batching_dims(dn)
    if eo in operand_batching:
        j = operand_batching.index(eo)
        return batch[ei] if ei is not None and ei == indices_batching[j] else MIXED
    if ei is not None or eo in dn.collapsed_slice_dims or eo in dn.start_index_map:
        return MIXED
    if _compat.param(eqn, "slice_sizes")[eo] != _shape(eqn.invars[0])[eo]:
        return MIXED
    kept = [
        d
        for d in range(len(_shape(eqn.invars[0])))
        if d not in dn.collapsed_slice_dims and d not in operand_batching
    ]
    return dn.offset_dims[kept.index(eo)]


def _split(eqn, labels) -> Any:
    return MIXED if labels[0] == _compat.param(eqn, "axis") else labels[0]


def _concatenate(eqn, labels) -> Any:
    e = _only(labels)
    return MIXED if e == _compat.param(eqn, "dimension") else e


def _stack(eqn, labels) -> Any:
    """`jnp.stack` (a primitive from jax 0.10 on): the new axis shifts the example
    axis when it goes before it."""
    e = _only(labels)
    if e == MIXED:
        return MIXED
    return e if e < _compat.param(eqn, "axis") else e + 1


def _window(eqn, labels) -> Any:
    """Pooling (`reduce_window_*`): per example if its window spans one example."""
    e, p = labels[0], functools.partial(_compat.param, eqn)
    if any(a is not None for a in labels[1:]):
        return MIXED
    ones = (1,) * (e + 1)
    one = (
        p("window_dimensions")[e] == 1
        and p("window_strides")[e] == 1
        and tuple(p("padding")[e]) == (0, 0)
        and p("base_dilation", ones)[e] == 1
        and p("window_dilation", ones)[e] == 1
    )
    return e if one else MIXED


def _tag(eqn, labels) -> Any:
    return labels[0]


def _scan(eqn, labels) -> list[Label]:
    """A scan equation (not kept by the tracer): its body, with the carry's labels
    settled as in `_kept_scan`."""
    scan = _compat.scan(eqn)
    body, num_consts, num_carry = scan.body, scan.num_consts, scan.num_carry
    if body is None:
        return [MIXED] * len(eqn.outvars)
    consts = labels[:num_consts]
    carry = labels[num_consts : num_consts + num_carry]
    xs = [_from_stacked(a) for a in labels[num_consts + num_carry :]]
    for _ in range(3):
        out = jaxpr_labels(body[0], [None] * len(body[1]), consts + carry + xs)
        new = [join(c, o) for c, o in zip(carry, out[:num_carry])]
        if new == carry:
            return carry + [_to_stacked(a) for a in out[num_carry:]]
        carry = new
    return [MIXED] * len(eqn.outvars)


_RULES: dict[str, Callable[[Any, list], Any]] = {
    **{name: _elementwise for name in _ELEMENTWISE},
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    **{
        name: _reduce
        for name in (
            "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
            "argmax argmin"
        ).split()
    },
    **{
        name: _along("axis")
        for name in "cumsum cumprod cummax cummin cumlogsumexp".split()
    },
    "sort": _along("dimension"),
    "rev": _along("dimensions"),
    "dot_general": _dot_general,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "pad": _pad,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "split": _split,
    **{
        name: _window
        for name in "reduce_window_sum reduce_window_max reduce_window_min".split()
    },
    "concatenate": _concatenate,
    "stack": _stack,
    loss_tag_p.name: _tag,
    loss_value_tag_p.name: _tag,
}
