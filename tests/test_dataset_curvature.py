"""`eqfisher.dataset_curvature`: the curvature of batches weighted by their examples,
against dense float64 references over the whole set and against `eqfisher.curvature`
of all the batches at once."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import (
    block_slices,
    compiled_during,
    dense_empirical_fisher,
    dense_ggn_cross_entropy,
)
from .test_scan import Scanned, ce


N = 23  # examples: batches of 8, 8 and 7
MODEL = eqx.nn.MLP(4, 3, 6, 1, activation=jnp.tanh, key=jr.key(0))
X, Y = jr.normal(jr.key(1), (N, 4)), jnp.arange(N) % 3
BATCHES = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, N, 8)]


def loss_fn(model, batch):
    x, y = batch[:2]
    mask = batch[2] if len(batch) == 3 else None
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y, mask=mask)


def per_example(model, example):
    x, y = example
    return -jax.nn.log_softmax(model(x))[y]


def blockwise(dense, structure):
    """The exact structures' view of a dense matrix: whole, per layer, diagonal."""
    if isinstance(structure, ef.Dense):
        return dense
    if isinstance(structure, ef.Diagonal):
        return np.diag(np.diag(dense))
    kept = np.zeros_like(dense)
    for layer in ((0, 1), (2, 3)):  # (weight, bias) of each layer
        rows = np.concatenate(
            [
                np.arange(block_slices(MODEL)[i].start, block_slices(MODEL)[i].stop)
                for i in layer
            ]
        )
        kept[np.ix_(rows, rows)] = dense[np.ix_(rows, rows)]
    return kept


@pytest.mark.parametrize(
    "structure", [ef.Dense(), ef.BlockDiagonal(), ef.Diagonal()], ids=repr
)
@pytest.mark.parametrize("estimator", [ef.GGN(), ef.EmpiricalFisher()], ids=repr)
def test_exact_structures_equal_the_whole_sets_dense_reference(estimator, structure):
    """Uneven batches (8, 8, 7): each weighted by its examples, so the result is the
    whole set's curvature, built without eqfisher."""
    if isinstance(estimator, ef.GGN):
        dense = dense_ggn_cross_entropy(MODEL, X, Y)
    else:
        dense = dense_empirical_fisher(per_example, MODEL, (X, Y))
    curv = ef.dataset_curvature(
        loss_fn, MODEL, iter(BATCHES), estimator=estimator, structure=structure
    )
    np.testing.assert_allclose(
        curv.as_matrix(), blockwise(dense, structure), rtol=1e-10, atol=1e-13
    )


def test_kfac_equals_kfac_of_the_whole_set():
    """K-FAC averages each factor, so the batches' K-FAC is the whole set's."""
    curv = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.KFAC()
    )
    whole = ef.curvature(
        loss_fn, MODEL, (X, Y), estimator=ef.GGN(), structure=ef.KFAC()
    )
    for name, block in whole.blocks.items():
        np.testing.assert_allclose(curv.blocks[name].a, block.a, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(curv.blocks[name].g, block.g, rtol=1e-12, atol=1e-14)


def test_a_batchs_weight_is_the_sum_of_its_mask():
    """Padded batches (the last padded from 7 to 8 examples, mask 0) equal the
    unpadded set: a batch weighs what its mask counts."""
    padded_x = jnp.concatenate([X, jnp.zeros((1, 4))])
    padded_y = jnp.concatenate([Y, jnp.zeros(1, Y.dtype)])
    mask = jnp.arange(N + 1) < N
    batches = [
        (padded_x[i : i + 8], padded_y[i : i + 8], mask[i : i + 8])
        for i in range(0, N + 1, 8)
    ]
    curv = ef.dataset_curvature(
        loss_fn, MODEL, batches, estimator=ef.GGN(), structure=ef.Dense()
    )
    np.testing.assert_allclose(
        curv.as_matrix(), dense_ggn_cross_entropy(MODEL, X, Y), rtol=1e-10, atol=1e-13
    )


def test_monte_carlo_batches_draw_with_their_index_folded_into_the_key():
    key = jr.key(5)
    estimator = ef.FisherMC(samples=2)
    curv = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=estimator, structure=ef.Diagonal(), key=key
    )
    by_hand = sum(
        len(b[1])
        / N
        * ef.curvature(
            loss_fn,
            MODEL,
            b,
            estimator=estimator,
            structure=ef.Diagonal(),
            key=jr.fold_in(key, i),
        ).as_matrix()
        for i, b in enumerate(BATCHES)
    )
    np.testing.assert_allclose(curv.as_matrix(), by_hand, rtol=1e-12, atol=1e-14)


def test_batches_of_one_shape_compile_once():
    traces = []

    def counted(model, batch):
        traces.append(None)
        return loss_fn(model, batch)

    batch = BATCHES[0]
    ef.dataset_curvature(
        counted, MODEL, [batch], estimator=ef.GGN(), structure=ef.KFAC()
    )
    once = len(traces)
    ef.dataset_curvature(
        counted, MODEL, [batch] * 3, estimator=ef.GGN(), structure=ef.KFAC()
    )
    assert once > 0 and len(traces) == once


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.EKFAC()], ids=repr)
def test_a_repeated_call_compiles_nothing(structure):
    """Both of EKFAC's passes, and the step between them, compile once."""

    def call():
        return ef.dataset_curvature(
            loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=structure
        )

    call()
    assert compiled_during(call) == []


def test_laplace_from_batches_equals_fit_on_the_whole_set():
    """docs/laplace.md: a posterior over a data set given as batches."""
    curv = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.KFAC()
    )
    loss = sum(len(b[1]) * loss_fn(MODEL, b) for b in BATCHES) / N
    posterior = ef.laplace.Laplace(
        curv, MODEL, loss=loss, num_data=N, likelihood="classification"
    )
    whole = ef.laplace.fit(
        loss_fn, MODEL, (X, Y), likelihood="classification", structure=ef.KFAC()
    )
    np.testing.assert_allclose(
        posterior.log_marginal_likelihood(), whole.log_marginal_likelihood(), rtol=1e-12
    )


def test_laplace_regression_from_batches_needs_its_outputs():
    """docs/laplace.md: for regression the recipe passes `num_outputs=D` (3 here);
    without it the Gaussian normaliser is a one-output model's."""

    def mse(model, batch):
        return ef.squared_error(jax.vmap(model)(batch[0]), batch[1])

    targets = jr.normal(jr.key(5), (N, 3))
    batches = [(X[i : i + 8], targets[i : i + 8]) for i in range(0, N, 8)]
    curv = ef.dataset_curvature(
        mse, MODEL, batches, estimator=ef.GGN(), structure=ef.KFAC()
    )
    loss = sum(len(b[1]) * mse(MODEL, b) for b in batches) / N
    whole = ef.laplace.fit(
        mse, MODEL, (X, targets), likelihood="regression", structure=ef.KFAC()
    )
    kwargs = dict(loss=loss, num_data=N, likelihood="regression", noise_std=0.3)
    posterior = ef.laplace.Laplace(curv, MODEL, num_outputs=3, **kwargs)
    want = whole.replace(noise_std=0.3).log_marginal_likelihood()
    np.testing.assert_allclose(posterior.log_marginal_likelihood(), want, rtol=1e-12)
    one = ef.laplace.Laplace(curv, MODEL, **kwargs).log_marginal_likelihood()
    np.testing.assert_allclose(
        one - want, 2 * N * np.log(0.3 * np.sqrt(2 * np.pi)), rtol=1e-10
    )


@pytest.mark.parametrize(
    "batches, error, match",
    [
        ((X, Y), TypeError, "of type tuple.*as a list"),
        (X, TypeError, "as a list"),
        ({"train": (X, Y)}, TypeError, "of type dict.*as a list"),
        ([], ValueError, "empty"),
    ],
    ids=["tuple", "array", "dict", "empty"],
)
def test_batches_that_are_not_a_list_of_batches_are_refused(batches, error, match):
    with pytest.raises(error, match=match):
        ef.dataset_curvature(
            loss_fn, MODEL, batches, estimator=ef.GGN(), structure=ef.KFAC()
        )


def _layer_basis(block) -> np.ndarray:
    """The columns `q_g[:, j] ⊗ q_a[:, k]` of an EKFAC block's eigenbasis, in the
    operand's order `(weight.ravel(), bias)` (the matrix view `[W b]` reordered)."""
    q_a, q_g = np.asarray(block.q_a), np.asarray(block.q_g)
    d_out, d_in = q_g.shape[0], q_a.shape[0] - 1
    view = np.arange(d_out * (d_in + 1)).reshape(d_out, d_in + 1)
    order = np.concatenate([view[:, :d_in].ravel(), view[:, d_in]])
    return np.kron(q_g, q_a)[order]


@pytest.mark.parametrize("estimator", [ef.GGN(), ef.EmpiricalFisher()], ids=repr)
def test_ekfac_is_the_whole_sets_diagonal_in_the_whole_sets_kfac_bases(estimator):
    """Two passes: K-FAC's eigenbases from all the batches, then the scales in those
    bases, batch by batch. The scales are the diagonal of the whole set's dense
    curvature (built without eqfisher) in the bases, which are the whole set's
    K-FAC's."""
    if isinstance(estimator, ef.GGN):
        dense = dense_ggn_cross_entropy(MODEL, X, Y)
    else:
        dense = dense_empirical_fisher(per_example, MODEL, (X, Y))
    curv = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=estimator, structure=ef.EKFAC()
    )
    kfac = ef.curvature(
        loss_fn, MODEL, (X, Y), estimator=estimator, structure=ef.KFAC()
    )
    slices = block_slices(MODEL)
    for (name, block), (w, b) in zip(curv.blocks.items(), ((0, 1), (2, 3))):
        rows = np.r_[slices[w], slices[b]]
        basis = _layer_basis(block)
        scales = np.diag(basis.T @ dense[np.ix_(rows, rows)] @ basis)
        np.testing.assert_allclose(
            block.as_matrix(), basis @ np.diag(scales) @ basis.T, rtol=1e-10, atol=1e-13
        )
        # Its bases are those of the whole set's K-FAC (an eigenbasis: Q_A^T A Q_A
        # is diagonal).
        for q, factor in (
            (block.q_a, kfac.blocks[name].a),
            (block.q_g, kfac.blocks[name].g),
        ):
            rotated = q.T @ factor @ q
            np.testing.assert_allclose(rotated, jnp.diag(jnp.diag(rotated)), atol=1e-12)
    whole = ef.curvature(
        loss_fn, MODEL, (X, Y), estimator=estimator, structure=ef.EKFAC()
    )
    np.testing.assert_allclose(
        curv.as_matrix(), whole.as_matrix(), rtol=1e-10, atol=1e-13
    )


def test_ekfac_of_a_scanned_model_equals_the_whole_sets():
    model = Scanned(jr.key(2))
    x, y = jr.normal(jr.key(3), (11, 4)), jnp.arange(11) % 2
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    curv = ef.dataset_curvature(
        ce, model, batches, estimator=ef.GGN(), structure=ef.EKFAC()
    )
    whole = ef.curvature(ce, model, (x, y), estimator=ef.GGN(), structure=ef.EKFAC())
    assert curv.runs == whole.runs  # stacked, as `eqfisher.curvature` stores them
    np.testing.assert_allclose(
        curv.as_matrix(), whole.as_matrix(), rtol=1e-10, atol=1e-13
    )


def test_monte_carlo_ekfac_draws_the_same_samples_in_both_passes():
    """Batch `i` draws with `fold_in(key, i)` in both passes, so the bases are those
    of the K-FAC of the same draws."""
    key = jr.key(7)
    estimator = ef.FisherMC(samples=2)
    curv = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=estimator, structure=ef.EKFAC(), key=key
    )
    kfac = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=estimator, structure=ef.KFAC(), key=key
    )
    for name, block in curv.blocks.items():
        for q, factor in (
            (block.q_a, kfac.blocks[name].a),
            (block.q_g, kfac.blocks[name].g),
        ):
            rotated = q.T @ factor @ q
            np.testing.assert_allclose(rotated, jnp.diag(jnp.diag(rotated)), atol=1e-12)


def test_ekfac_over_an_iterator_and_blocks_that_do_not_average_are_refused():
    with pytest.raises(TypeError, match="two passes.*list_iterator.*Pass a list"):
        ef.dataset_curvature(
            loss_fn, MODEL, iter(BATCHES), estimator=ef.GGN(), structure=ef.EKFAC()
        )
    # EKFAC inside `PerLayer` gives no fixed bases: its blocks are refused.
    mixed = ef.PerLayer(
        (ef.filters.by_path("layers[0].*"), ef.EKFAC()), default=ef.KFAC()
    )
    with pytest.raises(ValueError, match="EigenKroneckerFactored.*do not average"):
        ef.dataset_curvature(
            loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=mixed
        )


def test_eigen_kronecker_refuses_bases_of_another_layer():
    class WrongBases(ef.AbstractKroneckerStructure):
        weight_sharing: str = "expand"
        steps_alike = True

        def kronecker_needs(self):
            return ef.Needs(examples=True)

        def kronecker_block(self, group, statistics):
            other = ef.blocks.KroneckerFactored(
                jnp.eye(1),
                jnp.eye(2),
                weight_perm=(0, 1),
                structure=(jnp.zeros((2, 1)),),
            )
            return statistics.eigen_kronecker(bases=other)

    with pytest.raises(ValueError, match="bases=.*shaped.*same layer"):
        ef.curvature(
            loss_fn, MODEL, BATCHES[0], estimator=ef.GGN(), structure=WrongBases()
        )


def test_two_losses_and_a_missing_key_are_refused():
    def two(model, batch):
        return loss_fn(model, batch) + loss_fn(model, batch)

    with pytest.raises(ValueError, match="registers 2 losses"):
        ef.dataset_curvature(
            two, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.Diagonal()
        )
    with pytest.raises(ValueError, match="needs `key=`"):
        ef.dataset_curvature(
            loss_fn, MODEL, BATCHES, estimator=ef.FisherMC(), structure=ef.Diagonal()
        )


def test_a_scanned_models_stacked_blocks_average_over_batches():
    """Stacked blocks (a `lax.scan` over layers) average step by step."""
    model = Scanned(jr.key(2))
    x, y = jr.normal(jr.key(3), (11, 4)), jnp.arange(11) % 2
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    for structure in (ef.KFAC(), ef.BlockDiagonal()):
        curv = ef.dataset_curvature(
            ce, model, batches, estimator=ef.GGN(), structure=structure
        )
        whole = ef.curvature(ce, model, (x, y), estimator=ef.GGN(), structure=structure)
        np.testing.assert_allclose(
            curv.as_matrix(), whole.as_matrix(), rtol=1e-11, atol=1e-13
        )


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.EKFAC()], ids=repr)
@pytest.mark.parametrize(
    "masks",
    [
        [jnp.arange(8) < 6, jnp.arange(8) >= 2],  # 6 of 8 each
        [jnp.arange(8) < 5, jnp.ones(8, bool)],  # 5 of 8, then all 8
        [jnp.ones(8, bool), jnp.arange(8) < 1],  # a last batch padded from 1 to 8
    ],
    ids=["alike", "different", "padded-last"],
)
def test_kfac_of_masked_batches_equals_the_whole_set(structure, masks):
    """K-FAC's A averages every row, masked or not, G only the unmasked ones
    (docs/losses.md): the batches' A is weighted by their rows, G by their
    examples, so the result is the K-FAC of the batches together, however each
    masks. The factors are checked against factors built by hand."""
    batches = [(X[i : i + 8], Y[i : i + 8], m) for i, m in zip((0, 8), masks)]
    whole = (X[:16], Y[:16], jnp.concatenate(masks))
    curv = ef.dataset_curvature(
        loss_fn, MODEL, batches, estimator=ef.GGN(), structure=structure
    )
    want = ef.curvature(loss_fn, MODEL, whole, estimator=ef.GGN(), structure=structure)
    np.testing.assert_allclose(
        curv.as_matrix(), want.as_matrix(), rtol=1e-11, atol=1e-13
    )
    if isinstance(structure, ef.KFAC):
        # The first layer's A by hand: the mean over all 16 rows of [x 1][x 1]^T.
        rows = jnp.concatenate([X[:16], jnp.ones((16, 1))], axis=1)
        np.testing.assert_allclose(
            curv.blocks["layers[0]"].a, rows.T @ rows / 16, rtol=1e-12
        )


class _Pooled(eqx.Module):
    """Sequences of any length: a token-wise layer, a mean over the tokens, a head."""

    token: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jnp.mean(jax.vmap(self.token)(x), axis=0))


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_kfac_over_batches_of_different_sequence_lengths(weight_sharing):
    """A per-sequence loss over batches of 4 and 6 tokens: the token layer's A is
    the mean over every token of every sequence ("expand", 24 rows) or over every
    sequence's mean input ("reduce", 5 rows), G the batches' G by their sequences.
    Weighting A by the loss's rows (here the sequences) was 29% off for "expand"
    (and by a per-token loss's rows, for "reduce")."""
    model = _Pooled(
        eqx.nn.Linear(3, 5, dtype=jnp.float64, key=jr.key(4)),
        eqx.nn.Linear(5, 2, dtype=jnp.float64, key=jr.key(5)),
    )
    xs = [jr.normal(jr.key(6), (3, 4, 3)), jr.normal(jr.key(7), (2, 6, 3))]
    batches = [(x, jnp.arange(len(x)) % 2) for x in xs]
    structure = ef.KFAC(weight_sharing=weight_sharing)
    curv = ef.dataset_curvature(
        loss_fn, model, batches, estimator=ef.GGN(), structure=structure
    )
    if weight_sharing == "expand":
        rows = jnp.concatenate([x.reshape(-1, 3) for x in xs])
    else:
        rows = jnp.concatenate([x.mean(axis=1) for x in xs])
    rows = jnp.concatenate([rows, jnp.ones((len(rows), 1))], axis=1)
    np.testing.assert_allclose(
        curv.blocks["token"].a, rows.T @ rows / len(rows), rtol=1e-12
    )
    each = [
        ef.curvature(loss_fn, model, b, estimator=ef.GGN(), structure=structure)
        for b in batches
    ]
    for name in ("token", "head"):
        g = sum(len(b[1]) / 5 * c.blocks[name].g for b, c in zip(batches, each))
        np.testing.assert_allclose(curv.blocks[name].g, g, rtol=1e-12)


def test_an_exact_structure_weighs_masked_batches_by_their_examples():
    masks = [jnp.arange(8) < 5, jnp.ones(8, bool)]
    batches = [(X[i : i + 8], Y[i : i + 8], m) for i, m in zip((0, 8), masks)]
    dense = ef.dataset_curvature(
        loss_fn, MODEL, batches, estimator=ef.GGN(), structure=ef.Dense()
    )
    kept = jnp.concatenate(masks)
    np.testing.assert_allclose(
        dense.as_matrix(),
        dense_ggn_cross_entropy(MODEL, X[:16][kept], Y[:16][kept]),
        rtol=1e-10,
        atol=1e-13,
    )


def test_a_changing_factor_is_refused_under_jit():
    def summed(model, batch):
        return len(batch[1]) * loss_fn(model, batch)

    @eqx.filter_jit
    def jitted(batches):
        curv = ef.dataset_curvature(
            summed, MODEL, batches, estimator=ef.GGN(), structure=ef.KFAC()
        )
        return curv.as_matrix()

    with pytest.raises(eqx.EquinoxRuntimeError, match="another factor"):
        jax.block_until_ready(jitted(BATCHES))


def test_a_factor_that_changes_with_the_batch_is_refused():
    """A loss summed over its batch (`n * mean`) weighs batches by n twice."""

    def summed(model, batch):
        return len(batch[1]) * loss_fn(model, batch)

    with pytest.raises(ValueError, match=r"another factor on `batches\[2\]`.*Got 7"):
        ef.dataset_curvature(
            summed, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.Diagonal()
        )

    def doubled(model, batch):
        return 2.0 * loss_fn(model, batch)

    twice = ef.dataset_curvature(
        doubled, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.Diagonal()
    )
    once = ef.dataset_curvature(
        loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=ef.Diagonal()
    )
    np.testing.assert_allclose(twice.as_matrix(), 2 * once.as_matrix(), rtol=1e-14)


def test_a_sum_over_batches_of_one_size_is_the_mean_times_that_size():
    """docs: over batches of one size n, `n * mean` is refused nowhere (its factor
    is the same in every batch), and the result is the curvature of n times the
    mean loss, not of the whole set's sum."""
    batches = [(X[i : i + 8], Y[i : i + 8]) for i in (0, 8)]

    def summed(model, batch):
        return len(batch[1]) * loss_fn(model, batch)

    curv = ef.dataset_curvature(
        summed, MODEL, batches, estimator=ef.GGN(), structure=ef.Dense()
    )
    np.testing.assert_allclose(
        curv.as_matrix(),
        8 * dense_ggn_cross_entropy(MODEL, X[:16], Y[:16]),
        rtol=1e-10,
        atol=1e-13,
    )


def test_a_fixed_bases_that_is_not_a_pair_is_named():
    class Broken(ef.KFAC):
        def fixed_bases(self):
            return ef.KFAC()

    with pytest.raises(TypeError, match=r"Broken.fixed_bases\(\)` must return"):
        ef.dataset_curvature(
            loss_fn, MODEL, BATCHES, estimator=ef.GGN(), structure=Broken()
        )


def test_ema_takes_a_decay_for_each_stored_block():
    curv = ef.curvature(
        loss_fn, MODEL, BATCHES[0], estimator=ef.GGN(), structure=ef.KFAC()
    )
    other = ef.curvature(
        loss_fn, MODEL, BATCHES[1], estimator=ef.GGN(), structure=ef.KFAC()
    )
    mixed = curv.ema(other, {"layers[0]": 0.25, "layers[1]": 1.0})
    np.testing.assert_allclose(
        mixed.blocks["layers[0]"].a,
        0.25 * curv.blocks["layers[0]"].a + 0.75 * other.blocks["layers[0]"].a,
    )
    np.testing.assert_allclose(mixed.blocks["layers[1]"].g, curv.blocks["layers[1]"].g)
    with pytest.raises(ValueError, match="one decay for each stored block"):
        curv.ema(other, {"layers[0]": 0.5})
    with pytest.raises(
        ValueError, match=r"`decay\['layers\[1\]'\]` must lie in \[0, 1\]"
    ):
        curv.ema(other, {"layers[0]": 0.5, "layers[1]": 1.5})


def test_one_batch_given_as_a_list_of_its_arrays_is_named():
    """`[x, y]` is two batches, `x` and `y`; `loss_fn` then fails on `x`."""
    with pytest.raises(Exception) as info:
        ef.dataset_curvature(
            loss_fn, MODEL, [X, Y], estimator=ef.GGN(), structure=ef.Diagonal()
        )
    assert any("pass `[(x, y)]`" in note for note in info.value.__notes__)
