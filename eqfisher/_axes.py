"""Following array axes through structural equations.

A *labelling* gives each axis of an array a label (any hashable, or None for an axis
with no origin, such as one created by broadcasting). `follow` maps the labelling of
an operand to the labelling of the equation's output, or returns None when the
equation is not a pure relayout of that operand.
"""

from collections.abc import Sequence
from typing import Any

from ._program import Node


Labels = tuple[Any, ...]


def _non_singleton(shape: Sequence[int]) -> list[int]:
    return [i for i, n in enumerate(shape) if n != 1]


def follow(node: Node, labels: Labels) -> Labels | None:
    """The labels of `node`'s single output, given those of its first operand."""
    in_shape = tuple(node.eqn.invars[0].aval.shape)
    out_shape = tuple(node.eqn.outvars[0].aval.shape)
    name, params = node.name, node.params
    if name in ("convert_element_type", "copy", "copy_p"):
        return labels
    if name == "transpose":
        return tuple(labels[p] for p in params["permutation"])
    if name == "broadcast_in_dim":
        out: list[Any] = [None] * len(out_shape)
        for i, d in enumerate(params["broadcast_dimensions"]):
            # An operand axis of size 1 broadcast to a longer one has no origin.
            out[d] = labels[i] if in_shape[i] == out_shape[d] else None
        return tuple(out)
    if name == "squeeze":
        dims = {d % len(in_shape) for d in params["dimensions"]}
        return tuple(lab for i, lab in enumerate(labels) if i not in dims)
    if name == "reshape":
        if params.get("dimensions") is not None:
            return None
        src, dst = _non_singleton(in_shape), _non_singleton(out_shape)
        if [in_shape[i] for i in src] != [out_shape[j] for j in dst]:
            return None
        out = [None] * len(out_shape)
        for i, j in zip(src, dst):
            out[j] = labels[i]
        # Size-1 axes keep their labels, paired in order within the same gap between
        # non-singleton axes (vmap's reshapes move a batch of one this way).
        bounds_in = [-1, *src, len(in_shape)]
        bounds_out = [-1, *dst, len(out_shape)]
        for k in range(len(bounds_in) - 1):
            gap_in = range(bounds_in[k] + 1, bounds_in[k + 1])
            gap_out = range(bounds_out[k] + 1, bounds_out[k + 1])
            for i, j in zip(gap_in, gap_out):
                out[j] = labels[i]
        return tuple(out)
    return None
