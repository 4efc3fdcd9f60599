"""Picking parameter leaves of a model: filters, partitions and selective stop-gradient.

A *parameter* is an inexact array leaf, as in `eqx.filter(model, eqx.is_inexact_array)`.
Every function here takes a `where` saying which parameters to pick. It is either

- an [`eqfisher.filters.AbstractFilter`][], such as `by_path("layers[0].*")` or
  `by_type(eqx.nn.Linear)`, combined with `&`, `|` and `~`; or
- an Equinox filter spec: a PyTree prefix of the model whose leaves are `bool`s or
  callables `leaf -> bool`, exactly as accepted by `eqx.filter`.

Only parameters are ever picked, whatever `where` says about other leaves; a `where`
that picks no parameter raises a `ValueError` listing the model's parameter paths.
"""

import abc
import inspect
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree


__all__ = [
    "AbstractFilter",
    "by_path",
    "by_type",
    "combine",
    "mask",
    "optax_mask",
    "params",
    "partition",
    "stop_gradient",
]

_KeyPath = tuple[Any, ...]


class AbstractFilter(eqx.Module):
    """A predicate on the leaves of a model, combinable with `&`, `|` and `~`.

    Subclasses implement `__call__(path, leaf, nodes) -> bool`: `path` is the leaf's
    key path (as from `jax.tree_util.tree_flatten_with_path`) and `nodes` the nodes
    it walks through, from the model down to the leaf's parent (`path[i]` indexes
    into `nodes[i]`). Filters are evaluated on a model by [`eqfisher.filters.mask`][].

    !!! Example

        ```python
        class Matrices(ef.filters.AbstractFilter):  # leaves with two or more axes
            def __call__(self, path, leaf, nodes):
                return eqx.is_array(leaf) and leaf.ndim >= 2

        where = Matrices() & ~ef.filters.by_path("layers[1].*")
        selected = ef.filters.mask(model, where)
        assert selected.layers[0].weight and not selected.layers[0].bias
        assert not selected.layers[1].weight
        ```
    """

    @abc.abstractmethod
    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        """Whether the leaf at `path` is selected."""

    def __and__(self, other: "AbstractFilter") -> "AbstractFilter":
        return _And(self, other)

    def __or__(self, other: "AbstractFilter") -> "AbstractFilter":
        return _Or(self, other)

    def __invert__(self) -> "AbstractFilter":
        return _Not(self)


class _And(AbstractFilter):
    left: AbstractFilter
    right: AbstractFilter

    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        return self.left(path, leaf, nodes) and self.right(path, leaf, nodes)

    def __repr__(self) -> str:
        wrap = lambda f: f"({f!r})" if isinstance(f, _Or) else repr(f)
        return f"{wrap(self.left)} & {wrap(self.right)}"


class _Or(AbstractFilter):
    left: AbstractFilter
    right: AbstractFilter

    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        return self.left(path, leaf, nodes) or self.right(path, leaf, nodes)

    def __repr__(self) -> str:
        return f"{self.left!r} | {self.right!r}"


class _Not(AbstractFilter):
    operand: AbstractFilter

    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        return not self.operand(path, leaf, nodes)

    def __repr__(self) -> str:
        binary = isinstance(self.operand, (_And, _Or))
        return f"~({self.operand!r})" if binary else f"~{self.operand!r}"


class _ByPath(AbstractFilter):
    pattern: str = eqx.field(static=True)

    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        # `re` caches compiled patterns, so translating the glob per call is cheap.
        parts = self.pattern.removeprefix(".").split("*")
        regex = ".*".join(re.escape(part) for part in parts)
        # With and without the leading `.`: `*.weight` also picks a model's own
        # top-level `.weight`.
        key = jtu.keystr(path)
        return any(
            re.fullmatch(regex, k, re.DOTALL) is not None
            for k in (key, key.removeprefix("."))
        )

    def __repr__(self) -> str:
        return f"by_path({self.pattern!r})"


class _ByType(AbstractFilter):
    cls: type = eqx.field(static=True)

    def __call__(self, path: _KeyPath, leaf: Any, nodes: tuple[Any, ...]) -> bool:
        return any(isinstance(node, self.cls) for node in nodes)

    def __repr__(self) -> str:
        return f"by_type({self.cls.__name__})"


def by_path(pattern: str) -> AbstractFilter:
    """Select leaves whose `jax.tree_util.keystr` path matches a glob pattern.

    `*` matches any run of characters (dots and brackets included); every other
    character is literal, brackets too, since key paths contain them. The leading
    `.` of an attribute path is optional.

    ```python
    ef.filters.by_path("layers[0].*")     # .layers[0].weight, .layers[0].bias
    ef.filters.by_path("*.weight")        # every weight
    ef.filters.by_path("layers[*].bias")  # the bias of every layer
    ef.filters.by_path("['encoder']*")    # everything under the dict key 'encoder'

    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    first = ef.filters.mask(model, ef.filters.by_path("layers[0].*"))
    assert first.layers[0].weight and not first.layers[1].weight
    ```

    **Arguments:**

    - `pattern`: the glob pattern.

    **Returns:**

    An [`eqfisher.filters.AbstractFilter`][].

    **Raises:**

    Nothing here; a filter that selects no parameter raises a `ValueError` where
    it is used (`eqfisher.filters.mask`, `eqfisher.curvature(..., where=...)`).

    !!! Example

        ```python
        where = ef.filters.by_path("layers[1].*")  # the last layer only
        last = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense(),
            where=where,
        )
        print(last.as_matrix().shape)  # (27, 27): an 8 → 3 layer with its bias
        ```
    """
    if not isinstance(pattern, str):
        raise TypeError(
            "`eqfisher.filters.by_path(pattern)`: `pattern` must be a glob string "
            f"such as 'layers[0].*', got {pattern!r}."
        )
    return _ByPath(pattern)


def by_type(cls: type) -> AbstractFilter:
    """Select leaves lying, at any depth, inside a node that is an instance of `cls`.

    `by_type(eqx.nn.Linear)` selects the weight and bias of every `Linear`, however
    deeply nested; `by_type(eqx.nn.MLP) & ~by_path("*.bias")` the weights of MLPs.

    **Arguments:**

    - `cls`: the node type, typically an `eqx.Module` subclass.

    **Returns:**

    An [`eqfisher.filters.AbstractFilter`][].

    !!! Example

        ```python
        net = eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=key), eqx.nn.LayerNorm(8)])
        norm = ef.filters.mask(net, ef.filters.by_type(eqx.nn.LayerNorm))
        print(norm.layers[1].weight, norm.layers[0].weight)  # True False
        ```
    """
    if not isinstance(cls, type):
        raise TypeError(
            f"`eqfisher.filters.by_type(cls)`: `cls` must be a type, got {cls!r}."
        )
    return _ByType(cls)


def _leaves_with_nodes(tree: PyTree) -> list[tuple[_KeyPath, Any, tuple[Any, ...]]]:
    # `(path, leaf, nodes)` for every leaf, in `jax.tree_util.tree_leaves` order.
    out = []

    def walk(node, path, nodes):
        # Flatten one level only: every child, subtree or not, comes back as a leaf.
        children, treedef = jtu.tree_flatten_with_path(node, lambda x: x is not node)
        if treedef.num_nodes == 1:  # a leaf, or an empty node such as `None`
            out.extend([(path, node, nodes)] * treedef.num_leaves)
        else:
            for key_path, child in children:
                walk(child, path + key_path, nodes + (node,))

    walk(tree, (), ())
    return out


def _refuse_arrays(spec: Any, call: str, name: str) -> None:
    """Refuses a filter spec holding an array of booleans (one per weight, not per
    leaf), which `eqx.filter` reports as "traced" under `jit`."""
    arrays = [
        jtu.keystr(path)
        for path, leaf in jtu.tree_flatten_with_path(spec)[0]
        if eqx.is_array(leaf)
        and (isinstance(leaf, jax.core.Tracer) or np.ndim(leaf) > 0)
    ]
    if arrays:
        raise ValueError(
            f"`{call}`: `{name}` holds an array at {arrays[0] or '(the root)'}: a "
            "filter spec marks whole parameter leaves, `True`/`False` (or a callable) "
            "for each; eqfisher does not select single entries of a leaf (a "
            "subnetwork of chosen weights, as laplace-torch's `SubnetLaplace`). "
            "Select whole leaves, e.g. one layer's weight."
        )


def _flag(value: Any, call: str, name: str, at: str) -> bool:
    """A filter's answer for one leaf (`at` says which) as a Python bool, or a
    `TypeError` naming `name` when it is not one."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"`{call}`: `{name}` decided {at} from its values (it returned a traced "
            "array): filters are evaluated on the model inside `jit` too (as "
            "`eqfisher.curvature` does), so they must decide from a leaf's path, type "
            "or shape (e.g. `leaf.ndim >= 2`). For a choice by values, evaluate the "
            "mask once outside `jit`, `mask = eqfisher.filters.mask(model, where)`, "
            "and pass the mask as the filter spec."
        )
    if eqx.is_array(value) and np.shape(value) == () and value.dtype == bool:
        return bool(value)
    raise TypeError(
        f"`{call}`: `{name}` must return a bool for each leaf; for {at} it returned "
        f"{type(value).__name__}"
        f"{f' of shape {np.shape(value)}' if eqx.is_array(value) else ''}"
        f"{' (a missing `return`?)' if value is None else ''}."
    )


def _checked_spec(fn: Callable, call: str, name: str) -> Callable[[Any], bool]:
    """A callable of a filter spec (`leaf -> bool`, as `eqx.filter` calls it), its
    signature and answers checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: called as it is
        signature = None
    if signature is not None:
        try:
            signature.bind(None)
        except TypeError:
            raise TypeError(
                f"`{call}`: a callable in `{name}` is called with one leaf, `leaf -> "
                f"bool` (as `eqx.filter` calls it); {fn!r} takes {signature}. To "
                "choose by path, use `eqfisher.filters.by_path`, or subclass "
                "`eqfisher.filters.AbstractFilter` for `(path, leaf, nodes)`."
            ) from None
    return lambda leaf: _flag(fn(leaf), call, name, "a leaf")


def _mask(model: PyTree, where: Any, call: str, name: str) -> PyTree[bool]:
    call = f"eqfisher.filters.{call}"
    if isinstance(where, AbstractFilter):
        flags = [
            _flag(where(*entry), call, name, f"the leaf at {jtu.keystr(entry[0])!r}")
            for entry in _leaves_with_nodes(model)
        ]
        selected = jtu.tree_unflatten(jtu.tree_structure(model), flags)
    else:
        if isinstance(where, str):
            raise TypeError(
                f"`{call}`: `{name}` = {where!r} is a string; for a path pattern "
                f"pass `eqfisher.filters.by_path({where!r})`."
            )
        where = _none_as_false(where, model)
        _refuse_arrays(where, call, name)
        where = jtu.tree_map(
            lambda w: _checked_spec(w, call, name) if callable(w) else w, where
        )
        sentinel = object()
        try:
            kept = eqx.filter(model, where, replace=sentinel)
        except ValueError as e:
            raise ValueError(
                f"`{call}`: `{name}` is neither an `eqfisher.filters.AbstractFilter` "
                f"nor a filter spec (a PyTree prefix of the model): {e}"
            ) from e
        selected = jtu.tree_map(lambda leaf: leaf is not sentinel, kept)
    selected = jtu.tree_map(
        lambda s, leaf: bool(s) and eqx.is_inexact_array(leaf), selected, model
    )
    if not any(jtu.tree_leaves(selected)):
        leaves = jtu.tree_flatten_with_path(model)[0]
        paths = [jtu.keystr(p) for p, leaf in leaves if eqx.is_inexact_array(leaf)]
        more = f" (and {len(paths) - 5} more)" if len(paths) > 5 else ""
        raise ValueError(
            f"`{call}`: `{name}` = {where!r} selects no parameter (inexact array "
            f"leaf); the model's parameter paths include: "
            f"{', '.join(paths[:5]) or '(none)'}{more}."
        )
    return selected


def _none_as_false(where: Any, model: PyTree) -> Any:
    """A filter spec with `None` at the model's non-parameter leaves (as
    `optax_mask` returns it, and `eqx.filter(mask, ...)` makes) read as `False`
    there: Equinox takes a `None` for an empty subtree, and the structures then
    differ."""
    is_none = lambda x: x is None  # noqa: E731
    if not any(x is None for x in jtu.tree_leaves(where, is_leaf=is_none)):
        return where
    try:
        return jtu.tree_map(
            lambda w, _: False if w is None else w, where, model, is_leaf=is_none
        )
    except ValueError:  # not the model's structure: as it was given
        return where


def params(model: PyTree) -> PyTree:
    """The parameters of `model`: `eqx.filter(model, eqx.is_inexact_array)`.

    **Arguments:**

    - `model`: any PyTree, typically an `eqx.Module`.

    **Returns:**

    `model` with every leaf that is not an inexact array replaced by `None`.

    !!! Example

        ```python
        p = ef.filters.params(model)
        print(p.activation)  # None: a function is not a parameter
        print(sum(leaf.size for leaf in jax.tree.leaves(p)))  # 67 = 8·4 + 8 + 3·8 + 3
        ```
    """
    return eqx.filter(model, eqx.is_inexact_array)


def mask(model: PyTree, where: AbstractFilter | PyTree) -> PyTree[bool]:
    """Evaluate `where` against `model`.

    **Arguments:**

    - `model`: any PyTree, typically an `eqx.Module`.
    - `where`: a filter or filter spec (see [`eqfisher.filters`][]).

    **Returns:**

    A PyTree of `bool`s with the structure of `model`: `True` for each parameter
    `where` selects, `False` for every other leaf. A `where` selecting no parameter
    raises a `ValueError`.

    !!! Example

        ```python
        weights = ef.filters.mask(model, ef.filters.by_path("*.weight"))
        assert weights.layers[0].weight and not weights.layers[0].bias
        print([w.shape for w in jax.tree.leaves(eqx.filter(model, weights))])
        # [(8, 4), (3, 8)]
        ```
    """
    return _mask(model, where, "mask(model, where)", "where")


def partition(model: PyTree, *wheres: AbstractFilter | PyTree) -> tuple[PyTree, ...]:
    """Split `model` into `len(wheres) + 1` parts, like `eqx.partition`.

    A parameter goes to the part of the first `where` that selects it; the last part
    holds everything else, non-parameter leaves included, so that
    `combine(*partition(model, *wheres))` is `model`. For example
    `head, encoder, rest = partition(model, by_path("head*"), by_type(eqx.nn.MLP))`.

    **Arguments:**

    - `model`: any PyTree, typically an `eqx.Module`.
    - `*wheres`: filters or filter specs (see [`eqfisher.filters`][]).

    **Returns:**

    A tuple of PyTrees with the structure of `model`, unselected leaves `None`.

    !!! Example

        ```python
        first, rest = ef.filters.partition(model, ef.filters.by_path("layers[0].*"))
        print(first.layers[0].weight.shape, first.layers[1].weight)  # (8, 4) None
        assert eqx.tree_equal(ef.filters.combine(first, rest), model)
        ```
    """
    n = len(wheres)
    masks = [
        _mask(model, w, "partition(model, *wheres)", f"wheres[{i}]")
        for i, w in enumerate(wheres)
    ]
    # The index of the part each leaf goes to; `n` is the rest.
    first = lambda _, *s: next((i for i, selected in enumerate(s) if selected), n)
    owner = jtu.tree_map(first, model, *masks)
    return tuple(
        eqx.filter(model, jtu.tree_map(lambda o, i=i: o == i, owner))
        for i in range(n + 1)
    )


def combine(*pytrees: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """The inverse of `partition`: `combine(*partition(model, *wheres))` is `model`.

    `equinox.combine` under this module's name: each leaf is the first of
    `pytrees`' leaves at its place that is not `None`.

    **Arguments:**

    - `*pytrees`: PyTrees of one structure, `None` where a part has no leaf.
    - `is_leaf`: as `equinox.combine`'s: what else counts as a leaf.

    **Returns:**

    One PyTree of that structure.

    !!! Example

        ```python
        head, rest = ef.filters.partition(params, ef.filters.by_path("layers[1].*"))
        assert eqx.tree_equal(ef.filters.combine(head, rest), params)
        ```
    """
    return eqx.combine(*pytrees, is_leaf=is_leaf)


def stop_gradient(model: PyTree, where: AbstractFilter | PyTree) -> PyTree:
    """A view of `model` whose selected parameters get zero cotangents.

    Values are unchanged, so one function can use several views of one model (say
    `stop_gradient(model, True)` and `stop_gradient(model, ~by_path("encoder*"))`),
    each computation running once and each loss training its view's live parameters.

    **Arguments:**

    - `model`: any PyTree, typically an `eqx.Module`.
    - `where`: the parameters to stop (see [`eqfisher.filters`][]).

    **Returns:**

    `model` with `jax.lax.stop_gradient` applied to the selected parameters.

    !!! Example

        ```python
        def head_only(model, batch):  # the first layer is frozen
            frozen = ef.filters.stop_gradient(model, ef.filters.by_path("layers[0].*"))
            return loss_fn(frozen, batch)

        g = eqx.filter_grad(head_only)(model, batch)
        assert jnp.all(g.layers[0].weight == 0)
        assert jnp.array_equal(g.layers[1].weight, grads.layers[1].weight)
        ```
    """
    selected = _mask(model, where, "stop_gradient(model, where)", "where")
    return jtu.tree_map(
        lambda s, leaf: jax.lax.stop_gradient(leaf) if s else leaf, selected, model
    )


def optax_mask(model: PyTree, where: AbstractFilter | PyTree) -> PyTree[bool]:
    """A mask over `params(model)` for `optax.masked` and `optax.multi_transform`.

    To freeze the encoder: `frozen = optax_mask(model, by_path("encoder*"))` and
    `optax.chain(optax.adam(1e-3), optax.masked(optax.set_to_zero(), frozen))`.

    **Arguments:**

    - `model`: any PyTree, typically an `eqx.Module`.
    - `where`: the parameters to mark `True` (see [`eqfisher.filters`][]).

    **Returns:**

    A PyTree with the structure of `params(model)` (non-parameters `None`) holding
    `True` for selected parameters and `False` for the others.

    !!! Example

        ```python
        frozen = ef.filters.optax_mask(model, ef.filters.by_path("layers[0].*"))
        opt = optax.chain(optax.sgd(0.1), optax.masked(optax.set_to_zero(), frozen))
        updates, _ = opt.update(grads, opt.init(params), params)
        new = eqx.apply_updates(model, updates)
        assert jnp.array_equal(new.layers[0].weight, model.layers[0].weight)
        assert not jnp.array_equal(new.layers[1].weight, model.layers[1].weight)
        ```
    """
    selected = _mask(model, where, "optax_mask(model, where)", "where")
    return jtu.tree_map(
        lambda s, leaf: s if eqx.is_inexact_array(leaf) else None, selected, model
    )
