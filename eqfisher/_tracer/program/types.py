"""The data types of a flattened program: its variables (`PVar`, `StepVar`),
atoms, equations (`Node`, `ScanNode`), scan units and the `Program` itself, with
the symbolic one-step view that layer detection reads (`symbolic`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core

from ... import _compat


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


def holds_param(atom: "Atom") -> bool:
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
    # Each scan's symbolic units, cut by its `enter` link; `ScanNode.symbolic` keeps
    # its own (cut by nothing), which detection matches to these by variable.
    units_of: dict[int, tuple[Unit, ...]] = {}
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
        units_of[id(node)] = tuple(
            dataclasses.replace(u, nodes=(enter,)) for u in node.symbolic
        )
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
            units.extend(units_of[id(scan)])
    return Program(program.invars, tuple(nodes), program.outvars, tuple(units))


def scan_nodes(program: Program) -> tuple[ScanNode, ...]:
    return tuple(n for n in program.nodes if isinstance(n, ScanNode))
