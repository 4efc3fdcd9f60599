"""`PerLayer`: different structures for different layers, chosen with filters."""

import dataclasses
from typing import cast

import equinox as eqx
import jax
from jaxtyping import PyTree

from ... import filters
from .protocol import AbstractStructure, Group


def _leaf_mask(model: PyTree, where, part: int) -> list[bool]:
    """Per parameter leaf of `model`, whether `where` selects it."""
    leaves = jax.tree_util.tree_leaves(model)
    try:
        flags = jax.tree_util.tree_leaves(filters.mask(model, where))
    except ValueError as e:
        raise ValueError(f"`eqfisher.PerLayer(...)`: part {part}: {e}") from None
    return [f for f, x in zip(flags, leaves) if eqx.is_inexact_array(x)]


class PerLayer(AbstractStructure):
    """Different structures for different layers, chosen with filters.

    ```python
    structure = ef.PerLayer(
        (ef.filters.by_path("layers[1].*"), ef.Diagonal()),  # the output layer
        default=ef.KFAC(),
    )
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    assert isinstance(curv.blocks["layers[0]"], ef.blocks.KroneckerFactored)
    assert isinstance(curv.blocks["layers[1]"], ef.blocks.DiagonalBlock)
    ```

    Each layer (and each leaf in no layer) takes the structure of the first part
    whose filter selects its parameters, else `default`. A layer's parameters must
    all go to one part (select whole layers, e.g. `by_path("head.*")`). Each part
    groups its own layers: a `Dense()` part is one block over its layers, named
    `"all"` (so at most one part may be `Dense()`).

    **Arguments:**

    - `*parts`: `(where, structure)` pairs; `where` is an `eqfisher.filters` filter
      or an Equinox filter spec (as for `where=` of `eqfisher.curvature`).
    - `default`: the structure of the parameters no part selects.
    """

    parts: tuple[tuple[object, AbstractStructure], ...]
    default: AbstractStructure
    # A class variable cannot say whether every part's structure builds the steps
    # alike, so the steps' blocks are built one by one.
    steps_alike = False

    def __init__(self, *parts: tuple[object, AbstractStructure], default):
        # Pairs given as lists become tuples; `__check_init__` checks they are pairs.
        pairs = tuple(tuple(p) if isinstance(p, tuple | list) else (p,) for p in parts)
        self.parts = cast(tuple[tuple[object, AbstractStructure], ...], pairs)
        self.default = default

    def __check_init__(self):
        for i, part in enumerate(self.parts):
            if len(part) != 2 or not isinstance(part[1], AbstractStructure):
                raise TypeError(
                    f"`eqfisher.PerLayer(*parts, default=...)`: part {i} must be a "
                    "pair `(where, structure)` with a structure such as "
                    f"eqfisher.Diagonal(), got {part!r}."
                )
        if not isinstance(self.default, AbstractStructure):
            raise TypeError(
                "`eqfisher.PerLayer(*parts, default=...)`: `default` must be a "
                f"structure such as eqfisher.KFAC(), got {self.default!r}."
            )

    def _structures(self) -> tuple[AbstractStructure, ...]:
        return tuple(s for _, s in self.parts) + (self.default,)

    def groups(self, candidates, model):
        masks = [_leaf_mask(model, w, i) for i, (w, _) in enumerate(self.parts)]
        chosen: list[list[Group]] = [[] for _ in self._structures()]
        for g in candidates:
            parts = {
                next((k for k, m in enumerate(masks) if m[leaf]), len(masks))
                for leaf, _ in g.units
            }
            if len(parts) != 1:
                named = [
                    f"part {k}" if k < len(masks) else "`default`"
                    for k in sorted(parts)
                ]
                raise ValueError(
                    "`eqfisher.PerLayer(...)`: the "
                    f"parameters of `{g.name}` ({', '.join(g.paths)}) go to "
                    f"{' and '.join(named)}; a block's parameters need "
                    f"one structure. Select whole layers, e.g. {_whole(g)}."
                )
            chosen[parts.pop()].append(g)
        out = []
        for k, (structure, part) in enumerate(zip(self._structures(), chosen)):
            if part:
                out += [
                    dataclasses.replace(g, route=(k,) + g.route)
                    for g in structure.groups(tuple(part), model)
                ]
        names = [g.name for g in out]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(
                "`eqfisher.PerLayer(...)`: two parts "
                f"build blocks named {twice}, and a block's name must come from "
                "one part (a `Dense()` part's block is `'all'`: use at most one "
                "`Dense()` part; a structure of your own names its groups in its "
                "`groups`)."
            )
        return tuple(out)

    def _part(self, group: Group) -> tuple[AbstractStructure, Group]:
        k = group.route[0]
        return self._structures()[k], dataclasses.replace(group, route=group.route[1:])

    def needs(self, group):
        structure, group = self._part(group)
        return structure.needs(group)

    def block(self, group, statistics):
        structure, group = self._part(group)
        return structure.block(group, statistics)


def _whole(group: Group) -> str:
    """A filter that selects the parameters of `group`'s layer: its model path,
    or (a layer that is no submodule, `x @ self.V + self.c`) each of its leaves."""
    name = group.name.removeprefix(".")
    paths = [p.removeprefix(".") for p in group.paths]
    if all(p.startswith((f"{name}.", f"{name}[")) for p in paths):
        return f"`eqfisher.filters.by_path('{group.name}.*')`"
    parts = [f"eqfisher.filters.by_path('{p}')" for p in paths]
    return f"`{' | '.join(parts)}`"
