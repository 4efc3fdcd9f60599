"""How the examples of a batch relate inside `loss_fn`: a typed option of `curvature`
and `value_grad_and_curvature`, for the structures that need per-example vectors
(`Dense`, `BlockDiagonal`, `Diagonal`, EKFAC's scales, K-FAC's exact diagonal
blocks). Each kind computes those vectors its own way (`rows`), and says which
of them the main pass can give (`main_pass_rows`)."""

import abc
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree

from .._tracer import (
    LossProgram,
    Split,
    StagedLoss,
    proven_labels,
    stops_mixed_gradients,
)
from .estimators import AbstractEstimator, stacked_vectors
from .main_pass import MainPass, MainPassRows
from .outer_rows import outer_rows_possible
from .per_example import (
    example_count,
    examples_mismatch,
    main_pass_rows_possible,
    one_example,
    per_example_vectors,
    probe,
    shift_rows,
)
from .structures import Group


class AbstractExamples(eqx.Module):
    """How the examples of a batch relate inside `loss_fn`.

    `IndependentExamples` and `InteractingExamples` are its two kinds; both give
    the exact curvature, the first at a much lower cost.

    !!! Example

        For examples that do not interact, both give the same matrix:

        ```python
        def exact_diagonal(examples: ef.AbstractExamples):
            curv = ef.curvature(
                loss_fn,
                model,
                batch,
                estimator=ef.GGN(),
                structure=ef.Diagonal(),
                examples=examples,
            )
            return curv.as_matrix()

        independent = exact_diagonal(ef.IndependentExamples())
        interacting = exact_diagonal(ef.InteractingExamples())
        assert jnp.allclose(independent, interacting, atol=1e-6)
        ```

    eqfisher asks an examples kind two things, through the methods below: which
    groups' per-example vectors the main pass (one forward and VJP of the whole
    batch) gives, before it runs; and, after it, the per-example vectors.
    """

    def batch_leads(self) -> bool:
        """Whether the examples lie along the leading axis of every array of the
        batch (`kfac_step(curvature_batch_size=...)` takes the first ones there).
        True unless the kind says otherwise."""
        return True

    @abc.abstractmethod
    def main_pass_rows(
        self,
        processed: LossProgram,
        s: Split,
        batch: PyTree,
        groups: Sequence[Group],
    ) -> MainPassRows:
        """Which of `groups` take their exact per-example vectors from the main pass.

        **Arguments:**

        - `processed`: the `LossProgram` of `loss_fn` on the model and `batch`.
        - `s`: the model and `batch`, split into leaves.
        - `batch`: the batch.
        - `groups`: the groups with layers whose blocks need per-example vectors.

        **Returns:**

        A `MainPassRows`: those groups (none when the examples may interact), with
        the number of examples and the proof that they do not interact, where
        known.
        """

    @abc.abstractmethod
    def rows(
        self,
        staged: StagedLoss,
        estimator: AbstractEstimator,
        main: MainPass,
        parts: Sequence[int],
    ) -> tuple[dict[int, Array], Bool[Array, ""] | None]:
        """The exact per-example vectors of the parameters `parts`, and the check
        that they are exact.

        **Arguments:**

        - `staged`: `loss_fn`, with its `LossProgram`s (for a pass per example).
        - `estimator`: the estimator, whose output vectors are pulled back.
        - `main`: what the main pass gave, with its `MainPassRows`.
        - `parts`: parameter numbers (`LossProgram.units`).

        **Returns:**

        `(rows, interact)`. `rows`: per parameter number in `parts`, vectors
        `(m, *shape)` whose outer products sum to the exact curvature over that
        parameter; except the parameters of `main.main_rows.outer`'s groups, whose
        vectors the builder takes from the main pass (`outer_rows.py`).
        `interact`: None where the examples cannot interact or are proven not
        to, else a boolean array, true when they do (the builder then refuses
        every statistic from per-example vectors, `main.main_rows.outer`'s
        included).
        """


class IndependentExamples(AbstractExamples):
    """Examples do not interact inside `loss_fn` (the default).

    Per-example vectors come from re-running `loss_fn` on one example at a time; the
    outputs of that run, and their derivative along a fixed pseudo-random parameter
    direction, are compared with the same example's in the full batch, and a
    mismatch (batch statistics, shared randomness, a wrong example axis, a
    straight-through `m - jax.lax.stop_gradient(m)` of a batch mean, zero in value
    but not in derivative) raises an error.

    **Arguments:**

    - `axis`: where the example axis is in the batch's arrays: an int for all of
      them, or a PyTree prefix of `batch` of ints (or `None` for arrays shared by
      all examples), as `jax.vmap`'s `in_axes`. Default 0; time-major data
      `(T, N, F)` with labels `(N,)` is `axis=(1, 0)`. Scalar arrays are always
      shared. Each registered loss's example axis is found by comparison with the
      one-example run.

    !!! Example

        Inputs stored feature-major, `(4, 32)`, with labels `(32,)`:

        ```python
        def loss_t(model, batch):
            xt, y = batch
            return ef.softmax_cross_entropy(jax.vmap(model, in_axes=1)(xt), y)

        curv = ef.curvature(
            loss_t,
            model,
            (x.T, y),
            estimator=ef.GGN(),
            structure=ef.Diagonal(),
            examples=ef.IndependentExamples(axis=(1, 0)),
        )
        usual = ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Diagonal()
        )
        assert jnp.allclose(curv.as_matrix(), usual.as_matrix(), atol=1e-6)
        ```
    """

    axis: PyTree[int | None] = eqx.field(static=True, default=0)

    def __check_init__(self):
        _check_axes("IndependentExamples", self.axis)

    def batch_leads(self) -> bool:
        return isinstance(self.axis, int) and self.axis == 0

    def main_pass_rows(self, processed, s, batch, groups):
        if not groups:
            return MainPassRows()
        caller = processed.caller
        n = example_count(batch, self.axis, caller)
        if n is None:
            return MainPassRows()
        labels = proven_labels(processed.program, s, batch, self.axis, caller)
        shifts = [g for g in groups if main_pass_rows_possible(g.records, n, labels)]
        outer = [
            g
            for g in groups
            if g.kronecker and outer_rows_possible(g.records, n, labels)
        ]
        return MainPassRows(tuple(shifts), tuple(outer), n, labels)

    def rows(self, staged, estimator, main, parts):
        processed, s = main.processed, main.split
        shifts = main.main_rows.groups
        shifted = {i for g in shifts for i in g.param_indices}
        # The builder forms the outer products' vectors itself (`outer_rows`).
        outer = {i for g in main.main_rows.outer for i in g.param_indices}
        rest = [i for i in parts if i not in shifted | outer]
        rows, mismatch = {}, None
        if rest or main.main_rows.labels is None:
            rows, mismatch = _pass_per_example(
                staged, estimator, self.axis, main, parts, rest
            )
        n = main.main_rows.n_examples  # known where there are groups
        if shifts and n is not None:
            shapes = {i: processed.unit_shape(s.params, i)[0] for i in shifted}
            records = [r for g in shifts for r in g.records]
            rows |= shift_rows(
                records,
                main.layer_inputs,
                main.cotangents,
                n,
                shapes,
                main.main_rows.labels,
            )
        # None where proven at trace time (`example_axes`).
        return rows, mismatch


class InteractingExamples(AbstractExamples):
    r"""Examples interact inside `loss_fn` (BatchNorm with batch statistics, ...).

    The exact curvature then comes from full-batch products: one VJP through the
    whole batch per loss output coordinate (`GGN`, `FisherExact`), or per example
    (`EmpiricalFisher`, `FisherMC`), so its cost is about batch × outputs backward
    passes, against one per-example pass for `IndependentExamples`.

    **Arguments:**

    - `axis`: the example axis among each registered loss's leading axes (for
      `EmpiricalFisher` and `FisherMC`, whose vectors belong to whole examples).

    !!! Example

        A hidden layer normalised with batch statistics, against the exact GGN
        $\sum_n J_n^\top H_n J_n$ from `jax.jacfwd` ($J_n$: the Jacobian of example
        $n$'s logits in all parameters, through the batch statistics):

        ```python
        from jax.flatten_util import ravel_pytree

        def features(model, x):  # (32, 4) -> (32, 8), normalised over the batch
            h = jnp.tanh(jax.vmap(model.layers[0])(x))
            return (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-3)

        def loss_bn(model, batch):
            x, y = batch
            logits = jax.vmap(model.layers[1])(features(model, x))
            return ef.softmax_cross_entropy(logits, y)

        curv = ef.curvature(
            loss_bn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.Dense(),
            examples=ef.InteractingExamples(),
        )

        theta, unravel = ravel_pytree(params)
        static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

        def logits(theta):
            m = eqx.combine(unravel(theta), static)
            return jax.vmap(m.layers[1])(features(m, x))

        J = jax.jacfwd(logits)(theta)  # (32, 3, 67)
        p = jax.nn.softmax(logits(theta))
        H = (jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]) / 32
        ggn = jnp.einsum("nip,nij,njq->pq", J, H, J)
        assert jnp.allclose(curv.as_matrix(), ggn, atol=1e-5)
        ```
    """

    axis: int = eqx.field(static=True, default=0)

    def __check_init__(self):
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise TypeError(
                "`eqfisher.InteractingExamples(axis=...)`: the example axis among "
                f"a registered loss's leading axes, an int; got {self.axis!r}."
            )

    def main_pass_rows(self, processed, s, batch, groups):
        # An example's part of the batch's pullback holds the others' data too.
        return MainPassRows()

    def rows(self, staged, estimator, main, parts):
        for v in main.per_loss:  # (k, *leading, out)
            leading = v.ndim - 2
            if not 0 <= self.axis < leading:
                raise ValueError(
                    f"`{staged.caller}(..., examples=eqfisher.InteractingExamples("
                    f"axis={self.axis}))`: `axis` is the example axis among a "
                    f"registered loss's leading axes, 0 <= axis < {leading} for a "
                    f"loss whose inputs are shaped {v.shape[1:]} (the last axis is "
                    "the output's)."
                )
        full_vectors = stacked_vectors(
            [
                _checked(
                    estimator, "batch_vectors", estimator.batch_vectors(v, self.axis), v
                )
                for v in main.per_loss
            ]
        )
        p_ct, _ = jax.vmap(main.vjp)(full_vectors)
        return _unit_rows(main.processed, parts, p_ct), None


def _pass_per_example(staged, estimator, axis, main: MainPass, parts, rest):
    """`(rows, mismatch)`: the per-example vectors of the parameters `rest` from a
    pass per example, and the check that the examples do not interact (for all of
    `parts`, whose other vectors come from the main pass)."""
    processed, s = main.processed, main.split
    full_inputs = [loss.inputs for loss in main.losses]
    one = one_example(staged, main.model, main.batch, full_inputs, axis)
    derivatives = stops_mixed_gradients(
        processed.program, s, main.batch, axis, staged.caller
    )
    if not rest:
        leaves = sorted({processed.units[i][0] for i in parts})
        along = probe(processed, s, leaves, derivatives)
        return {}, examples_mismatch(one, full_inputs, along)
    leaves = sorted({processed.units[i][0] for i in rest})
    vecs, mismatch = per_example_vectors(
        one,
        main.per_loss,
        full_inputs,
        lambda v: stacked_vectors(
            [
                _checked(estimator, "example_vectors", estimator.example_vectors(x), x)
                for x in v
            ]
        ),
        probe(processed, s, leaves, derivatives),
    )
    return _unit_rows(processed, rest, dict(zip(leaves, vecs))), mismatch


def _checked(estimator, method: str, out: Array, vectors: Array) -> Array:
    """An estimator's `example_vectors`/`batch_vectors`, refused unless shaped
    `(k', *vectors.shape[1:])` in `vectors`' dtype: another shape or dtype gave
    JAX's VJP or vmap errors, naming neither."""
    shape, dtype = jnp.shape(out), getattr(out, "dtype", None)
    if shape[1:] != vectors.shape[1:] or dtype != vectors.dtype:
        raise ValueError(
            f"`{type(estimator).__name__}.{method}` must return vectors shaped "
            f"(k, {', '.join(map(str, vectors.shape[1:]))}) in {vectors.dtype} (the "
            f"vectors it is given are {vectors.shape}), got {shape} in {dtype}."
        )
    return out


def _unit_rows(processed: LossProgram, parts, by_leaf) -> dict[int, Array]:
    """Each parameter number's rows, from rows of whole leaves `by_leaf[leaf]`."""
    rows = {}
    for i in parts:
        leaf, index = processed.units[i]
        rows[i] = by_leaf[leaf][(slice(None),) + index]
    return rows


def _check_axes(name: str, axis: PyTree) -> None:
    """`axis` holds ints (and `None`s), as `jax.vmap`'s `in_axes`."""
    for a in jax.tree_util.tree_leaves(axis):
        if not isinstance(a, int) or isinstance(a, bool):
            raise TypeError(
                f"`eqfisher.{name}(axis=...)`: the example axis must be an int, or "
                "a PyTree prefix of the batch of ints and `None`s (as `jax.vmap`'s "
                f"`in_axes`), got {a!r}."
            )
