"""Evaluating a `Program`: `VarMap` (perturbations as a PyTree), the interpreter
`evaluate` and what one pass of it saw (`Evaluation`), kept scans included.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ... import _compat
from ...losses import loss_tag_p
from .types import Atom, Const, Program, PVar, ScanNode, StepVar


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
    read_means: Mapping[int, tuple[int, ...]] | None = None,
) -> Evaluation:
    """Runs the program, adding `perturbations` to the variables they name.

    A perturbation may be smaller than its variable, with size-1 axes where the
    variable's are larger: it is broadcast, and its cotangent is the sum over them.

    With `stop_after_tags=k`, stops right after the k-th loss tag (the rest of the
    program only turns tag outputs into the loss value). A `StepVar` can be read
    from the result only when it (or its stacked variable) is among `reads`: the
    scan then returns its values for every step. `read_means` maps a stacked
    variable's `id` to axes of one step's value that the scan averages over (in at
    least float32, keeping them as size 1) before returning it: the scan then stores
    the means, not the values.
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
            outs = _run_scan(node, ev, extra, emit, read_means or {})
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


def mean_over(x: Any, axes: tuple[int, ...] | None) -> Any:
    """`x` averaged over `axes` in at least float32, keeping them (None: `x`)."""
    if axes is None:
        return x
    dtype = jnp.float32 if jnp.finfo(x.dtype).bits < 32 else x.dtype
    return jnp.mean(x.astype(dtype), axis=axes, keepdims=True)


def _run_scan(
    node: ScanNode,
    ev: Evaluation,
    extra: Mapping[int, Any],
    emit: set[int],
    means: Mapping[int, tuple[int, ...]],
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
        reads = [mean_over(env[id(v)], means.get(id(st))) for v, st in emitted]
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
        unroll=_compat.scan(node.eqn).unroll,
    )
    for (_, st), r in zip(emitted, reads):
        ev.env[id(st)] = r
    return list(carry) + list(ys)
