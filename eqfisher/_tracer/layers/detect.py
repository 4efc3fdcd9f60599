"""Layer kinds and their detection on a flattened program.

Detection works on equations, not on module types, so `eqx.nn.Linear` under
`jax.vmap`, a raw `x @ w + b`, an `einsum` and an attention projection are all the
same thing to it: a `dot_general` with a parameter on one side, perhaps followed by a
bias added along the output features. A layer declared with
`eqfisher.register_dense` is found by its tag, whatever computes it.

`detect` runs the steps of detection, each a function from values to values, one
module each (see the package's `__init__`): `Graph.of` (`graph`), `candidates`
(`candidates`), `judge` (`verdict`), then, here, `_records` and `_unmatched`: the
kept layers in model order, and a reason for every parameter in none.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx

from ..._config import current_config
from ..analyses import axes
from ..declare import layer_tag_p
from ..program import SYMBOLIC, Node, Program, PVar, ScanNode, scan_nodes, symbolic
from .candidates import Candidate, candidates, declaration_fault
from .graph import Graph, sources, unit_paths
from .kinds import AbstractLayerKind, LayerKindName
from .verdict import Verdict, judge


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
    kind: LayerKindName = eqx.field(static=True)
    param_paths: tuple[str, ...] = eqx.field(static=True)
    uses: int = eqx.field(static=True, default=1)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerRecord:
    """Everything the curvature code needs to know about one detected layer.

    `kind` is the layer's kind as a type (`kinds`; its `name` is what `LayerInfo`
    says). `inputs`/`outputs` are program variables: the activation (or the indices
    of an embedding) and the output that is perturbed to read output cotangents.
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

    name: str
    kind: AbstractLayerKind
    param_paths: tuple[str, ...]
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
    def declared(self) -> bool:
        """Whether the layer was declared (`eqfisher.register_dense`): its output
        is what the user says, not a product the tracer saw."""
        return self.core.eqn.primitive is layer_tag_p

    @property
    def info(self) -> LayerInfo:
        """What `find_layers` reports of it. Built on demand: a scanned layer has a
        record per step, and an `eqx.Module` per record costs tracing time."""
        return LayerInfo(self.name, self.kind.name, self.param_paths)


@dataclasses.dataclass(frozen=True)
class Detection:
    layers: tuple[LayerRecord, ...]
    unmatched: tuple[tuple[str, str], ...]  # (path, reason)


# ---------------------------------------------------------------------------
# Records and reasons (after `verdict`).


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
    cand: Candidate,
    numbering: _Numbering,
    indices: tuple[int, ...] | None = None,
    inputs: Any = None,
    outputs: PVar | None = None,
    like: LayerRecord | None = None,
) -> LayerRecord:
    """The record of a kept candidate; a scan body's candidate at one step gives
    that step's `indices`, `inputs` and `outputs`, and copies the rest from `like`
    (its record at another step: a long scan has a record per step)."""
    indices = cand.indices if indices is None else indices
    outputs = cand.outputs if outputs is None else outputs
    assert outputs is not None  # a kept candidate's output reaches a loss
    paths = tuple(numbering.paths[i] for i in indices)
    name = layer_name(paths)
    steps = {
        numbering.orders[i][1] if i >= numbering.num_leaves else None for i in indices
    }
    if len(steps) == 1 and (step := steps.pop()) is not None:
        # One scan step's slices: the step index comes last, `blocks.attn.q[2]`.
        base = [numbering.leaf_paths[numbering.orders[i][0]] for i in indices]
        name = layer_name(base) + "".join(f"[{k}]" for k in step)
    if like is not None:
        return dataclasses.replace(
            like,
            name=name,
            param_paths=paths,
            param_indices=indices,
            inputs=inputs,
            outputs=outputs,
        )
    out_shape = outputs.aval.shape
    d_out = math.prod(out_shape[i] for i in axes.feature_axes(cand.out_labels))
    return LayerRecord(
        name=name,
        kind=cand.kind,
        param_paths=paths,
        param_indices=indices,
        inputs=cand.activation if inputs is None else inputs,
        outputs=outputs,
        in_order=cand.in_order,
        out_order=axes.matrix_order(cand.out_labels),
        d_in=cand.d_in,
        d_out=d_out,
        weight_perm=cand.weight_perm,
        core=cand.core,
    )


def _kept(cands, verdict: Verdict, graph: Graph) -> list[Candidate]:
    """The candidates that stay and reach a loss."""
    return [
        c
        for c in cands
        if id(c) not in verdict.dropped and id(c.outputs) in graph.reach
    ]


def _records(cands, verdict: Verdict, graph: Graph) -> tuple[LayerRecord, ...]:
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
    """Each record named by its first use: later uses of the same parameters (a
    tied layer, a layer at every step of an unrolled scan) keep that name, and
    another layer of the same name is told apart as `name#2`, `name#3`, ..."""
    seen: dict[str, int] = {}
    named: dict[tuple[int, ...], str] = {}
    out = []
    for r in records:
        name = named.get(r.param_indices)
        if name is None:
            seen[r.name] = seen.get(r.name, 0) + 1
            name = r.name if seen[r.name] == 1 else f"{r.name}#{seen[r.name]}"
            named[r.param_indices] = name
        out.append(r if name == r.name else dataclasses.replace(r, name=name))
    return tuple(out)


_CONTROL_FLOW = frozenset({"scan", "cond", "while"})
# `register_dense` declarations that declare no layer, with why.
_Faults = list[tuple[Node, str]]


def _unmatched(
    records: Sequence[LayerRecord], verdict: Verdict, graph: Graph
) -> tuple[tuple[str, str], ...]:
    used = {i for r in records for i in r.param_indices}
    split = graph.program.stacked()
    faults = _faulty_declarations(graph)
    out = []
    for i in sorted(range(len(graph.paths)), key=graph.model_order):
        if i in used or id(graph.srcvars[i]) in split:  # stacked: see its units
            continue
        out.append((graph.paths[i], _reason(i, verdict, graph, faults)))
    return tuple(out)


def _reason(index: int, verdict: Verdict, graph: Graph, faults: _Faults) -> str:
    fault = _declaration_fault(graph, index, faults)
    if fault is not None:
        return fault
    if index in verdict.reasons:
        return verdict.reasons[index]
    if id(graph.srcvars[index]) not in graph.reach:
        if id(graph.srcvars[index]) in graph.value_reach:
            return "reaches the registered losses only through `stop_gradient` (zero curvature)"
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
    view = _view(graph, index)
    return "no layer pattern" if view is None else view


def _faulty_declarations(graph: Graph) -> _Faults:
    """The `register_dense` declarations that declare no layer, and why."""
    faults = [(n, declaration_fault(n, graph)) for n in graph.program.nodes]
    return [(node, fault) for node, fault in faults if fault is not None]


def _declaration_fault(graph: Graph, index: int, faults: _Faults) -> str | None:
    """Why a `register_dense` declaration that a parameter feeds (as its weight or
    bias, or through what computes them) declares no layer; None when it feeds none
    such."""
    if not faults:
        return None
    down = {id(graph.srcvars[index])}
    for node in graph.program.nodes:
        if any(id(a) in down for a in node.args):
            down.update(id(o) for o in node.outs if o is not None)
    for node, fault in faults:
        if any(id(a) in down for a in node.operands[2:]):
            return f"declared with `eqfisher.register_dense`, not honoured: {fault}"
    return None


def _view(graph: Graph, index: int) -> str | None:
    """Why a parameter first read through a reversal (`rev`), or a slice of several
    steps of its leading axis (not one step, as an unrolled scan reads a stacked
    leaf), is no layer's weight; None for any other parameter."""
    matched = "a layer's weight is matched as the leaf itself or one step of it"
    for user in graph.consumers.get(id(graph.srcvars[index]), []):
        out = user.eqn.outvars[0].aval.shape
        whole = user.eqn.invars[0].aval.shape
        several = (
            user.name == "slice"
            and len(out) > 0
            and out[0] > 1
            and out[1:] == whole[1:]
        )
        axes = (
            tuple(user.eqn.params.get("dimensions", ())) if user.name == "rev" else ()
        )
        if several or 0 in axes:
            return (
                f"read through `{user.name}` (a reversed or sliced view of its "
                "leading axis, as `leaf[::-1]` or `leaf[1:]`) before its use: "
                f"{matched}"
            )
        if axes:
            return (
                f"read flipped along axes {axes} (`rev`, as `jnp.flip`) before its "
                f"use: {matched}; store it flipped, or use `eqx.nn.ConvTranspose` for "
                "a transposed convolution"
            )
    return None


def _control_flow_user(graph: Graph, index: int) -> str | None:
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
    a kept scan (`program.ScanNode`) are found once, on its body with symbolic
    units (`program.symbolic`), and given one record per step.
    """
    seen = symbolic(program)
    graph = Graph.of(seen, leaf_paths)
    cands = candidates(graph)
    verdict = judge(cands, graph)
    if seen is program:
        records = _records(cands, verdict, graph)
        return Detection(records, _unmatched(records, verdict, graph))
    return _every_step(program, graph, cands, verdict)


def _every_step(program: Program, graph: Graph, cands, verdict: Verdict) -> Detection:
    """Records and reasons of `program` from the detection on its symbolic
    program (`graph`): a candidate in a scan body gives one record per step, a
    symbolic unit's reason holds for each step's unit."""
    numbering = _numbering(program, graph.leaf_paths)
    numbers = _step_numbers(program, graph)
    body_of = {id(n): scan for scan in scan_nodes(program) for n in scan.body}
    records = []
    for cand in _kept(cands, verdict, graph):
        scan = body_of.get(id(cand.core))
        if scan is None:
            indices = tuple(numbers.moved[i] for i in cand.indices)
            records.append(_record(cand, numbering, indices))
        else:
            records += _scan_records(cand, scan, numbering, numbers)
    records = _in_order(records, numbering)
    unmatched = _step_unmatched(program, graph, verdict, records, numbering, numbers)
    return Detection(records, unmatched)


class _StepNumbers(NamedTuple):
    """How the symbolic program's parameter numbers map to the real program's:
    `per_step[k][t]` for a symbolic unit `k` at step `t`, `moved[k]` otherwise."""

    per_step: dict[int, dict[int, int]]
    moved: dict[int, int]

    def at(self, k: int, step: int) -> int:
        return self.per_step[k][step] if k in self.per_step else self.moved[k]


def _step_numbers(program: Program, graph: Graph) -> _StepNumbers:
    number = {id(u): graph.num_leaves + j for j, u in enumerate(program.units)}
    per_step: dict[int, dict[int, int]] = {}
    moved: dict[int, int] = {i: i for i in range(graph.num_leaves)}
    scans = scan_nodes(program)
    for j, u in enumerate(graph.program.units):
        k = graph.num_leaves + j
        # `symbolic(program)` copies a scan's symbolic units; the variables stay.
        scan = next(
            (sc for sc in scans if any(s.var is u.var for s in sc.symbolic)), None
        )
        if scan is None:
            moved[k] = number[id(u)]
            continue
        per_step[k] = {
            r.index[0]: number[id(r)] for r in scan.units if r.leaf == u.leaf
        }
    return _StepNumbers(per_step, moved)


def _scan_records(
    cand: Candidate, scan: ScanNode, numbering: _Numbering, numbers: _StepNumbers
) -> list[LayerRecord]:
    """A scan body's candidate's record at each step; the steps after the first
    copy what does not change (`_record(..., like=...)`)."""
    inside = scan.body_vars()

    def at(var, step):
        return scan.step_var(var, step) if id(var) in inside else var

    records: list[LayerRecord] = []
    for step in scan.steps:
        indices = tuple(numbers.at(i, step) for i in cand.indices)
        like = records[0] if records else None
        records.append(
            _record(
                cand,
                numbering,
                indices,
                at(cand.activation, step),
                at(cand.outputs, step),
                like=like,
            )
        )
    return records


def _step_unmatched(
    program: Program,
    graph: Graph,
    verdict: Verdict,
    records: Sequence[LayerRecord],
    numbering: _Numbering,
    numbers: _StepNumbers,
) -> tuple[tuple[str, str], ...]:
    """The parameters in no record, with the reason of their symbolic number (at
    their step)."""
    used = {i for r in records for i in r.param_indices}
    back = {v: k for k, v in numbers.moved.items()}
    for k, steps in numbers.per_step.items():
        back.update({v: k for v in steps.values()})
    split = program.stacked()
    srcvars = sources(program, graph.num_leaves)
    faults = _faulty_declarations(graph)
    unmatched = []
    for i in sorted(range(len(numbering.paths)), key=lambda i: numbering.orders[i]):
        if i in used or id(srcvars[i]) in split:
            continue
        k = back[i]
        reason = _reason(k, verdict, graph, faults)
        if k in numbers.per_step:
            step = numbering.orders[i][1][0]
            reason = reason.replace(f"[{SYMBOLIC}]", f"[{step}]")
        unmatched.append((numbering.paths[i], reason))
    return tuple(unmatched)


def layer_name(paths: Sequence[str]) -> str:
    """The common prefix of a layer's parameter paths: its model path."""
    return _layer_name(tuple(paths))


@functools.lru_cache(maxsize=4096)
def _layer_name(paths: tuple[str, ...]) -> str:
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
