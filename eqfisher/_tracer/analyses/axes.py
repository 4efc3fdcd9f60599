"""Axis labels, and following them through structural equations.

A *labelling* gives each axis of an array a label, or None for an axis with no
origin (one created by broadcasting). Two kinds of label are used:

- a leaf axis (an `int`): which axis of a parameter leaf a view's axis comes from;
- a `Location` or `Feature` of a layer output: the axes K-FAC flattens into the rows
  (locations: examples, sequence positions, pixels) and the columns (features) of
  its `(locations, d_out)` output matrix, numbered in the order they flatten.

`follow` maps the labelling of an operand to the labelling of the equation's
output, or returns None when the equation is not a pure relayout of that operand.
"""

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import TypeVar

from ... import _compat
from ..program import Node


@dataclasses.dataclass(frozen=True, order=True)
class Location:
    """The `index`-th location axis of a layer output (a row of its matrix)."""

    index: int


@dataclasses.dataclass(frozen=True, order=True)
class Feature:
    """The `index`-th feature axis of a layer output (a column of its matrix)."""

    index: int


OutputLabel = Location | Feature | None
L = TypeVar("L", bound=Hashable)


def output_labels(
    rank: int, features: Sequence[int], skip: Sequence[int] = ()
) -> tuple[OutputLabel, ...]:
    """Labels an output of `rank` axes: `features` (in order) are features, the
    `skip` axes have no label, and the rest are locations in axis order."""
    out: list[OutputLabel] = []
    for axis in range(rank):
        if axis in features:
            out.append(Feature(list(features).index(axis)))
        elif axis in skip:
            out.append(None)
        else:
            out.append(Location(sum(isinstance(lab, Location) for lab in out)))
    return tuple(out)


def location_axes(labels: Sequence[OutputLabel]) -> tuple[int, ...]:
    return tuple(i for i, lab in enumerate(labels) if isinstance(lab, Location))


def feature_axes(labels: Sequence[OutputLabel]) -> tuple[int, ...]:
    """The feature axes, in feature order."""
    feats = [(lab.index, i) for i, lab in enumerate(labels) if isinstance(lab, Feature)]
    return tuple(i for _, i in sorted(feats))


def matrix_order(labels: Sequence[OutputLabel]) -> tuple[int, ...]:
    """The output axes as (locations..., unlabelled..., features...): transposed so,
    an output reshapes to its `(locations, d_out)` matrix."""
    locs = [(lab.index, i) for i, lab in enumerate(labels) if isinstance(lab, Location)]
    rest = tuple(i for i, lab in enumerate(labels) if lab is None)
    return tuple(i for _, i in sorted(locs)) + rest + feature_axes(labels)


def _non_singleton(shape: Sequence[int]) -> list[int]:
    return [i for i, n in enumerate(shape) if n != 1]


def follow(node: Node, labels: tuple[L | None, ...]) -> tuple[L | None, ...] | None:
    """The labels of `node`'s single output, given those of its first operand."""
    in_shape = tuple(node.eqn.invars[0].aval.shape)
    out_shape = tuple(node.eqn.outvars[0].aval.shape)
    name, param = node.name, functools.partial(_compat.param, node.eqn)
    if name in ("convert_element_type", "copy", "copy_p"):
        return labels
    if name == "transpose":
        return tuple(labels[p] for p in param("permutation"))
    if name == "broadcast_in_dim":
        out: list[L | None] = [None] * len(out_shape)
        for i, d in enumerate(param("broadcast_dimensions")):
            # An operand axis of size 1 broadcast to a longer one has no origin.
            out[d] = labels[i] if in_shape[i] == out_shape[d] else None
        return tuple(out)
    if name == "squeeze":
        dims = {d % len(in_shape) for d in param("dimensions")}
        return tuple(lab for i, lab in enumerate(labels) if i not in dims)
    if name == "reshape":
        return _follow_reshape(in_shape, out_shape, param("dimensions", None), labels)
    return None


def _follow_reshape(in_shape, out_shape, dimensions, labels):
    if dimensions is not None:
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
