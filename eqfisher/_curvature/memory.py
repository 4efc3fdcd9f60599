"""`memory_estimate`: the bytes of the curvature blocks and of an optimiser's state,
from shapes alone (`jax.eval_shape`), before anything is computed."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .estimators import AbstractEstimator
from .examples import AbstractExamples
from .fits import measuring
from .functions import curvature
from .operator import Curvature
from .structures import AbstractStructure


def _is_shaped(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _eval_shape(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`eqx.filter_eval_shape` that also takes `jax.ShapeDtypeStruct` leaves as
    inputs, so a model or batch built only from shapes can be passed."""
    dynamic, static = eqx.partition((args, kwargs), _is_shaped)
    out_static = []

    def run(dynamic):
        a, k = eqx.combine(dynamic, static)
        out_dynamic, s = eqx.partition(fn(*a, **k), eqx.is_array)
        out_static.append(s)
        return out_dynamic

    out_dynamic = jax.eval_shape(run, dynamic)
    return eqx.combine(out_dynamic, out_static[0])


def _arrays(tree: PyTree) -> list[Any]:
    return [x for x in jax.tree_util.tree_leaves(tree) if _is_shaped(x)]


def _nbytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in _arrays(tree))


def _size(n: int) -> str:
    """`n` bytes, human-readable (binary prefixes)."""
    scaled: float = n
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(scaled) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{scaled:.1f} {unit}"
        scaled /= 1024
    raise AssertionError  # unreachable


class BlockMemory(NamedTuple):
    """The arrays of one curvature block.

    - `name`: the block's name (the layer's model path), as in `Curvature.blocks`.
    - `kind`: the block's type, e.g. `"KroneckerFactored"`.
    - `shapes`: the shape of each of its arrays (for K-FAC, the two factors).
    - `nbytes`: their bytes together.

    !!! Example

        ```python
        estimate = ef.memory_estimate(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        head = estimate.blocks[0]  # largest first: A is 9 x 9, G is 3 x 3
        assert head.name == "layers[1]" and head.kind == "KroneckerFactored"
        assert head.shapes == ((9, 9), (3, 3))
        assert head.nbytes == (81 + 9) * 4  # float32
        ```
    """

    name: str
    kind: str
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int


class MemoryEstimate(eqx.Module):
    """What `memory_estimate` reports: bytes, from shapes.

    **Fields:**

    - `parameters`: the bytes of the selected parameters (the same again for their
      gradient, and for every optimiser buffer shaped like them).
    - `blocks`: a `BlockMemory` per curvature block, largest first.
    - `optimiser_state`: the bytes of `optimiser.init(params)`, or `None` when no
      optimiser was given.

    **Properties:** `curvature` (the blocks' bytes together) and `total`
    (parameters, gradient, curvature and optimiser state).

    `str(estimate)` is a short table.

    !!! Example

        ```python
        estimate = ef.memory_estimate(
            loss_fn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.KFAC(),
            optimiser=optax.adam(1e-3),  # two buffers shaped like the parameters
        )
        assert estimate.parameters == 67 * 4  # 67 float32 parameters
        assert estimate.curvature == sum(b.nbytes for b in estimate.blocks)
        assert estimate.optimiser_state > 2 * estimate.parameters
        assert estimate.total == (
            2 * estimate.parameters + estimate.curvature + estimate.optimiser_state
        )
        print(estimate)
        ```
    """

    parameters: int
    blocks: tuple[BlockMemory, ...]
    optimiser_state: int | None

    @property
    def curvature(self) -> int:
        """The bytes of all curvature blocks."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def total(self) -> int:
        """Parameters, gradient, curvature and optimiser state, in bytes."""
        return 2 * self.parameters + self.curvature + (self.optimiser_state or 0)

    def __str__(self) -> str:
        shown = 8
        lines = [
            f"parameters        {_size(self.parameters):>10}  (gradient the same)",
            f"curvature         {_size(self.curvature):>10}  "
            f"({len(self.blocks)} block{'' if len(self.blocks) == 1 else 's'})",
        ]
        for b in self.blocks[:shown]:
            shapes = ", ".join("×".join(map(str, s)) or "()" for s in b.shapes)
            lines.append(f"  {_size(b.nbytes):>10}  {b.name}: {b.kind} [{shapes}]")
        if len(self.blocks) > shown:
            rest = sum(b.nbytes for b in self.blocks[shown:])
            lines.append(
                f"  {_size(rest):>10}  ... {len(self.blocks) - shown} more blocks"
            )
        if self.optimiser_state is not None:
            lines.append(f"optimiser state   {_size(self.optimiser_state):>10}")
        lines.append(f"total             {_size(self.total):>10}")
        return "\n".join(lines)


def memory_estimate(
    loss_fn: Callable[[PyTree, PyTree], Float[Array, ""]],
    model: PyTree,
    batch: PyTree,
    *,
    estimator: AbstractEstimator,
    structure: AbstractStructure,
    key: PRNGKeyArray | jax.ShapeDtypeStruct | None = None,
    where=None,
    examples: AbstractExamples | None = None,
    optimiser: optax.GradientTransformation | None = None,
) -> MemoryEstimate:
    """The memory the curvature and an optimiser's state will take, from shapes.

    Traces `eqfisher.curvature(...)` and `optimiser.init(params)` with
    `jax.eval_shape`: nothing is computed or allocated, so it answers for a model
    too large to build statistics for (and `model`, `batch` may hold
    `jax.ShapeDtypeStruct`s in place of arrays, e.g. from `eqx.filter_eval_shape`).
    The numbers are the arrays that persist — the blocks and the state; the
    temporaries of computing them (activations, per-example Jacobians) are not
    counted (`jax.jit(...).lower(...).compile().memory_analysis()` gives those,
    at the cost of a compilation).

    **Arguments:**

    - `loss_fn`, `model`, `batch`, `estimator`, `structure`, `key`, `where`,
      `examples`: as for `eqfisher.curvature` (`key` may be a
      `jax.ShapeDtypeStruct`; `examples=None` is its default).
    - `optimiser`: an optax transformation (e.g. `eqfisher.optim.kfac(lr,
      like=...)`) whose `init` state to measure, or `None`.

    **Returns:**

    A `MemoryEstimate`; `print` it for a table, or read `.curvature`,
    `.optimiser_state`, `.total` (bytes).

    **Raises:**

    What `eqfisher.curvature` raises for these arguments (checked while tracing),
    and a `TypeError` when `optimiser` is not an optax transformation.

    !!! Example

        ```python
        estimate = ef.memory_estimate(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
        )
        print(estimate)  # blocks largest first, e.g. an output head's G factor
        assert estimate.curvature < 2**30
        ```
    """
    curv = _curvature_shapes(
        loss_fn,
        model,
        batch,
        estimator=estimator,
        structure=structure,
        key=key,
        where=where,
        examples=examples,
    )
    params = eqx.filter(model, lambda x: _is_shaped(x) and _inexact(x))
    return MemoryEstimate(
        _nbytes(params), _block_memory(curv), _optimiser_bytes(optimiser, params)
    )


def _curvature_shapes(loss_fn, model, batch, *, examples, **kwargs) -> Curvature:
    """`eqfisher.curvature(...)` traced with `jax.eval_shape`: its blocks hold
    `jax.ShapeDtypeStruct`s."""
    with measuring():
        curv = _eval_shape(
            curvature,
            loss_fn,
            model,
            batch,
            **kwargs,
            **({} if examples is None else {"examples": examples}),
        )
    if not isinstance(curv, Curvature):  # pragma: no cover - curvature's contract
        raise TypeError(f"expected a `Curvature`, got {type(curv).__name__}")
    return curv


def _block_memory(curv: Curvature) -> tuple[BlockMemory, ...]:
    """A `BlockMemory` per block of `curv`, largest first."""
    blocks = [
        BlockMemory(
            name,
            type(block).__name__,
            tuple(tuple(x.shape) for x in _arrays(block)),
            _nbytes(block),
        )
        for name, block in curv.blocks.items()
    ]
    return tuple(sorted(blocks, key=lambda b: -b.nbytes))


def _optimiser_bytes(
    optimiser: optax.GradientTransformation | None, params: PyTree
) -> int | None:
    """The bytes of `optimiser.init(params)`, from shapes; `None` without one."""
    if optimiser is None:
        return None
    if not isinstance(optimiser, optax.GradientTransformation):
        raise TypeError(
            "`eqfisher.memory_estimate(..., optimiser=...)` needs an optax "
            "transformation (e.g. `eqfisher.optim.kfac(lr, like=...)`), got "
            f"{type(optimiser).__name__}."
        )
    return _nbytes(_eval_shape(optimiser.init, params))


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)
