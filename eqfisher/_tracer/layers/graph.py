"""Facts about the program: where layer detection starts (`graph` → `candidates`
→ `verdict` → `detect`).

`Graph` holds what `candidates`, `verdict` and `detect` read: the parameters (leaves, then scan
units), the views of each through structural equations, the consumers of every
variable and what reaches a registered loss.
"""

import dataclasses
import functools
import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ...losses import loss_tag_p
from ..analyses import axes
from ..program import STRUCTURAL, Node, Program, PVar


class View(NamedTuple):
    """A parameter seen through structural equations."""

    # Which parameter (leaf or scan unit); the field hides `tuple.index`.
    index: int  # pyright: ignore[reportIncompatibleMethodOverride]
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


def _views(program: Program, srcvars: Sequence[PVar]) -> dict[int, View]:
    views = {
        id(v): View(i, tuple(range(len(v.aval.shape))), ())
        for i, v in enumerate(srcvars)
    }
    for node in program.nodes:
        if node.name not in STRUCTURAL or not node.args:
            continue
        base = views.get(id(node.operand(0)))
        if base is None:
            continue
        labels = axes.follow(node, base.labels)
        if labels is not None:
            views[id(node.outs[0])] = View(base.index, labels, base.nodes + (node,))
    return views


def _reaching_losses(program: Program, *, derivatives: bool) -> frozenset[int]:
    """The ids of the variables a registered loss depends on: through its
    derivatives (`derivatives=True`: not through a `stop_gradient`, whose
    operand's curvature is zero), or in value."""
    # Repeated until nothing is added: a scan body's `loop` link (see
    # `program.symbolic`) feeds the body's carry back to its start.
    reach: set[int] = set()
    size = -1
    while size != len(reach):
        size = len(reach)
        for node in reversed(program.nodes):
            if node.eqn.primitive is loss_tag_p:
                reach.add(id(node.operand(0)))
            elif derivatives and node.eqn.primitive.name == "stop_gradient":
                continue
            elif any(o is not None and id(o) in reach for o in node.outs):
                reach.update(id(a) for a in node.args)
    return frozenset(reach)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """What every step of detection reads: the program, its parameters and their views."""

    program: Program
    num_leaves: int
    leaf_paths: tuple[str, ...]
    paths: tuple[str, ...]  # of every parameter index (leaves, then units)
    srcvars: tuple[PVar, ...]
    shapes: tuple[tuple[int, ...], ...]
    views: Mapping[int, View]
    consumers: Mapping[int, list[Node]]
    # ids of the variables a registered loss's derivatives depend on (not through
    # a `stop_gradient`)
    reach: frozenset[int]

    @classmethod
    def of(cls, program: Program, leaf_paths: Sequence[str]) -> "Graph":
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
            reach=_reaching_losses(program, derivatives=True),
        )

    @functools.cached_property
    def value_reach(self) -> frozenset[int]:
        """The ids of the variables a registered loss depends on in value (through
        a `stop_gradient` too): for the reason given to a parameter outside
        `reach`, computed once."""
        return _reaching_losses(self.program, derivatives=False)

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
