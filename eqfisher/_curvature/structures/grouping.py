"""The grouping helpers `eqfisher.curvature` runs a structure with: the candidate
groups of a `LossProgram` (one per layer, one per parameter in no layer), and the
check of the groups a structure's `groups` returns."""

import collections

import jax

from ..._tracer import LayerRecord
from .protocol import AbstractStructure, Group


def candidates(processed, selected: list[int], unsupported) -> tuple[Group, ...]:
    """One group per layer over its selected parameters, and one per selected
    parameter in no layer, in model order.

    `processed` is a `LossProgram`, `selected` the selected leaves, and
    `unsupported(record)` says why a layer has no Kronecker factors (or None).
    Parameter numbers are `LossProgram.units`: whole leaves, or, for a stacked
    leaf read by a scan, its per-step units.
    """
    parts = processed.parts(selected)
    chosen = set(parts)
    avals = [v.aval for v in processed.program.invars]

    def shape(i):
        leaf, index = processed.units[i]
        aval = avals[leaf]
        return jax.ShapeDtypeStruct(aval.shape[len(index) :], aval.dtype)

    def group(name, layer, param_indices, records, kronecker, reason):
        return Group(
            name=name,
            layer=layer,
            paths=tuple(processed.paths[i] for i in param_indices),
            shapes=tuple(shape(i) for i in param_indices),
            kronecker=kronecker,
            unsupported=reason,
            param_indices=param_indices,
            units=tuple(processed.units[i] for i in param_indices),
            records=records,
        )

    applications: dict[tuple[int, ...], list[LayerRecord]] = {}
    for r in processed.layers:
        applications.setdefault(r.param_indices, []).append(r)
    out, covered = [], set()
    for indices, records in applications.items():
        r = records[0]
        kept = tuple(i for i in indices if i in chosen)
        if not kept:
            continue
        covered.update(kept)
        reason = unsupported(r)
        weight_in = r.weight_perm is not None and indices[0] in chosen
        kron = weight_in and reason is None
        # A layer without a weight (scale-and-shift) is not refused, only diagonal.
        refused = reason if weight_in and r.weight_perm is not None else None
        out.append(group(r.name, r.info, kept, tuple(records), kron, refused))
    for i in parts:
        if i not in covered:
            out.append(
                group(processed.paths[i].lstrip("."), None, (i,), (), False, None)
            )
    out.sort(key=lambda g: min(processed.units[i] for i in g.param_indices))
    return tuple(out)


def check_groups(
    structure: AbstractStructure, groups, candidates: tuple[Group, ...], caller: str
) -> tuple[Group, ...]:
    """Checks that a structure's `groups` cover each candidate parameter once."""
    if not isinstance(groups, tuple) or not all(isinstance(g, Group) for g in groups):
        raise TypeError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            f".groups` must return a tuple of `eqfisher.Group`s, got {groups!r}."
        )
    want = sorted(i for g in candidates for i in g.param_indices)
    got = sorted(i for g in groups for i in g.param_indices)
    if got != want:
        raise ValueError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            ".groups` must cover every candidate parameter exactly once."
        )
    counts = collections.Counter(g.name for g in groups)
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice:
        raise ValueError(
            f"`{caller}(..., structure={structure!r})`: `{type(structure).__name__}"
            f".groups` must name each group once (its block's name in "
            f"`Curvature.blocks`); {twice} name more than one."
        )
    return tuple(groups)
