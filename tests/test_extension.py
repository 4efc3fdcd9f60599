"""A structure and an estimator defined outside eqfisher, with its public API only,
against dense float64 references written without eqfisher (`kfac_reference.py`)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .kfac_reference import (
    as_matrix,
    dense_ggn,
    kfac_factors,
    kronecker_dense,
    layer_slice,
)


F64 = jnp.float64
N, IN, HIDDEN, OUT = 7, 3, 6, 4


class DiagonalOutputKFAC(ef.AbstractStructure):
    """K-FAC whose output factor G is kept diagonal for layers wider than `max_out`;
    the exact diagonal elsewhere."""

    max_out: int = eqx.field(static=True)
    steps_alike = True

    def groups(self, candidates, model):
        return candidates

    def needs(self, group):
        if group.kronecker:
            return ef.Needs(kronecker=True)
        return ef.Needs(examples=True)

    def block(self, group, statistics):
        if not group.kronecker:
            return statistics.diagonal()
        g = statistics.g
        if g.shape[0] > self.max_out:
            g = jnp.diag(jnp.diagonal(g))
        return ef.blocks.KroneckerFactored(
            statistics.a,
            g,
            weight_perm=statistics.weight_perm,
            structure=statistics.shapes,
        )


class DiagonalHessianGGN(ef.AbstractEstimator):
    """Σₙ Jₙᵀ diag(Hₙ) Jₙ: the GGN with each loss Hessian replaced by its diagonal."""

    needs_key = False
    splits_positions = True

    def output_vectors(self, loss, key):
        s = loss.family.sqrt_hessian(loss.inputs)  # (*leading, out, k): S Sᵀ = H
        scale = jnp.sqrt(jnp.sum(s**2, axis=-1) * loss.weights()[..., None])
        eye = jnp.eye(scale.shape[-1], dtype=scale.dtype)
        # Vector i is √(wₙ Hₙᵢᵢ) eᵢ.
        return jnp.einsum("...i,ik->k...i", scale, eye)

    def example_vectors(self, vectors):
        return ef.GGN().example_vectors(vectors)

    def batch_vectors(self, vectors, axis):
        return ef.GGN().batch_vectors(vectors, axis)


def _problem():
    model = eqx.nn.MLP(
        IN, OUT, HIDDEN, 1, activation=jnp.tanh, dtype=F64, key=jr.key(2)
    )
    kx, ky = jr.split(jr.key(3))
    return model, (jr.normal(kx, (N, IN), F64), jr.randint(ky, (N,), 0, OUT))


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _diagonal(h):
    return jnp.diag(jnp.diagonal(h))


def test_user_structure_matches_its_definition():
    model, (x, y) = _problem()
    curv = ef.curvature(
        loss_fn, model, (x, y), estimator=ef.GGN(), structure=DiagonalOutputKFAC(5)
    )
    # layers[0] has 6 outputs (G diagonal), layers[1] 4 (G dense).
    expected = np.zeros((model_size(model),) * 2)
    for k in (0, 1):
        a, g = kfac_factors(model, x, y, k)
        if g.shape[0] > 5:
            g = np.diag(np.diag(g))
        idx = layer_slice(model, k)
        expected[np.ix_(idx, idx)] = kronecker_dense(a, g)
    np.testing.assert_allclose(as_matrix(curv), expected, rtol=1e-10, atol=1e-12)
    g0 = curv.blocks["layers[0]"].g
    assert jnp.count_nonzero(g0 - jnp.diag(jnp.diagonal(g0))) == 0


def model_size(model) -> int:
    return sum(
        p.size
        for p in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    )


@pytest.mark.parametrize(
    "structure, examples",
    [
        (ef.Dense(), ef.IndependentExamples()),
        (ef.BlockDiagonal(), ef.InteractingExamples()),
    ],
)
def test_user_estimator_matches_its_definition(structure, examples):
    model, (x, y) = _problem()
    curv = ef.curvature(
        loss_fn,
        model,
        (x, y),
        estimator=DiagonalHessianGGN(),
        structure=structure,
        examples=examples,
    )
    expected = dense_ggn(model, x, y, _diagonal)
    if isinstance(structure, ef.BlockDiagonal):
        mask = np.zeros_like(expected, dtype=bool)
        for k in (0, 1):
            idx = layer_slice(model, k)
            mask[np.ix_(idx, idx)] = True
        expected = np.where(mask, expected, 0.0)
    np.testing.assert_allclose(as_matrix(curv), expected, rtol=1e-10, atol=1e-12)


def test_user_estimator_with_user_structure():
    # K-FAC's G is built from the estimator's vectors: G = Σₙ Jₙᵀ diag(Hₙ) Jₙ.
    model, (x, y) = _problem()
    curv = ef.curvature(
        loss_fn,
        model,
        (x, y),
        estimator=DiagonalHessianGGN(),
        structure=DiagonalOutputKFAC(10),
    )
    for k in (0, 1):
        a, g = kfac_factors(model, x, y, k, _diagonal)
        np.testing.assert_allclose(
            as_matrix(curv.blocks[f"layers[{k}]"]),
            kronecker_dense(a, g),
            rtol=1e-10,
            atol=1e-12,
        )


def test_a_structure_without_its_methods_cannot_be_made():
    class Incomplete(ef.AbstractStructure):
        steps_alike = False

        def groups(self, candidates, model):
            return candidates

    with pytest.raises(TypeError, match="abstract.*block.*needs"):
        Incomplete()


def test_an_estimator_without_its_methods_cannot_be_made():
    class Incomplete(ef.AbstractEstimator):
        needs_key = False
        splits_positions = False

        def output_vectors(self, loss, key):
            return ef.GGN().output_vectors(loss, key)

    with pytest.raises(TypeError, match="abstract.*batch_vectors.*example_vectors"):
        Incomplete()


class NoSampleAxis(ef.AbstractEstimator):
    """Vectors without their leading `k` axis: JAX's "unexpected JAX type ... for
    argument to VJP function" deep in the pull-back, naming nothing of the user's."""

    needs_key = False
    splits_positions = False

    def output_vectors(self, loss, key):
        return ef.GGN().output_vectors(loss, key)[0]

    def example_vectors(self, vectors):
        return vectors

    def batch_vectors(self, vectors, axis):
        return vectors


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.Diagonal()])
def test_an_estimators_vectors_of_the_wrong_shape_are_named(structure):
    model, batch = _problem()
    with pytest.raises(ValueError, match=r"`NoSampleAxis.output_vectors` must return"):
        ef.curvature(
            loss_fn, model, batch, estimator=NoSampleAxis(), structure=structure
        )


class KroneckerEverywhere(ef.AbstractStructure):
    """Asks for Kronecker factors even where a group has none."""

    steps_alike = False

    def groups(self, candidates, model):
        return candidates

    def needs(self, group):
        return ef.Needs(kronecker=True)

    def block(self, group, statistics):
        return statistics.kronecker()


class _FromExamples(ef.AbstractStructure):
    """A block per candidate group, from the per-example vectors (`block`: the
    exact diagonal, which the subclasses below misuse)."""

    steps_alike = False

    def groups(self, candidates, model):
        return candidates

    def needs(self, group):
        return ef.Needs(examples=True)

    def block(self, group, statistics):
        return statistics.diagonal()


class NoBlock(_FromExamples):
    def block(self, group, statistics):
        return statistics.rows


class SwappedOperand(_FromExamples):
    """A diagonal block over `(bias, weight)`, where the group is `(weight, bias)`:
    `as_matrix` and `trace` read it anyway (as_matrix's diagonal was 0.82 off)."""

    def block(self, group, statistics):
        d = statistics.diagonal()
        return ef.blocks.DiagonalBlock(tuple(reversed(d.diag)))


class OneName(_FromExamples):
    """Every group named "x": the blocks overwrote each other in `Curvature.blocks`."""

    def groups(self, candidates, model):
        return tuple(dataclasses.replace(g, name="x") for g in candidates)


def test_a_structure_is_checked_where_it_answers():
    model, batch = _problem()
    with pytest.raises(TypeError, match=r"`NoBlock.block` must return"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=NoBlock())
    with pytest.raises(ValueError, match=r"`SwappedOperand.block` returned.*shaped"):
        ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=SwappedOperand()
        )
    with pytest.raises(ValueError, match=r"name each group once.*\['x'\]"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=OneName())
    where = ef.filters.by_path("*.bias")
    with pytest.raises(ValueError, match=r"asks for Kronecker factors.*`layers\[0\]`"):
        ef.curvature(
            loss_fn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=KroneckerEverywhere(),
            where=where,
        )


class ScaledFull(ef.blocks.AbstractBlock):
    """A user block type, c·M for a `Full` M, made with the public API only."""

    inner: ef.blocks.Full
    c: float

    def mv(self, vector):
        return tuple(self.c * x for x in self.inner.mv(vector))

    def as_matrix(self):
        return self.c * self.inner.as_matrix()

    def in_structure(self):
        return self.inner.in_structure()

    def solve(self, vector, damping):
        return tuple(x / self.c for x in self.inner.solve(vector, damping / self.c))

    def diagonal(self):
        return tuple(self.c * x for x in self.inner.diagonal())

    def logdet(self, damping):
        size = self.as_matrix().shape[0]
        return self.inner.logdet(damping / self.c) + size * jnp.log(self.c)

    def trace(self):
        return self.c * self.inner.trace()

    def eigenvalues(self):
        return self.c * self.inner.eigenvalues()

    def ema(self, other, decay):
        return ScaledFull(
            self.inner.scale(self.c).ema(other.inner.scale(other.c), decay), 1.0
        )

    def scale(self, c):
        return ScaledFull(self.inner, self.c * c)


def test_a_user_block_type_is_refused_where_nothing_is_registered_for_it():
    m = jr.normal(jr.key(0), (3, 3), F64)
    block = ScaledFull(ef.blocks.Full(m @ m.T, (jnp.zeros(3, F64),)), 2.0)
    v = (jnp.ones(3, F64),)
    dense = 2.0 * m @ m.T
    (solved,) = block.solve(v, 0.5)  # the block itself works
    np.testing.assert_allclose(solved, jnp.linalg.solve(dense + 0.5 * jnp.eye(3), v[0]))
    with pytest.raises(TypeError, match=r"tikhonov_inverse.*`ScaledFull`.*register"):
        ef.optim.tikhonov_inverse(block, 0.1)
    with pytest.raises(TypeError, match=r"sqrt_inverse_mv.*`ScaledFull`.*register"):
        ef.laplace.sqrt_inverse_mv(block, v, 1.0, 0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(weight_sharing="reduced"),
        dict(max_factor_dim=-3),
        dict(max_factor_dim=True),
        dict(max_factor_dim=2.5),
    ],
)
def test_needs_refuses_what_kfac_refuses(unchecked, kwargs):
    # `Needs(weight_sharing="reduced")` (a typo) computed "expand"'s factors, and
    # `Needs(max_factor_dim=-3)` made every factor diagonal: `KFAC` refuses both.
    (name,) = kwargs
    for make in (ef.Needs, ef.KFAC):
        with pytest.raises(ValueError, match=rf"\({name}=\.\.\.\)`: expected"):
            make(**kwargs)


class _Summed(ef.losses.Gaussian):
    def per_example(self, inputs, targets):  # the sum over examples too
        return 0.5 * jnp.sum((inputs - targets) ** 2)


class _Integer(ef.losses.Gaussian):
    def per_example(self, inputs, targets):
        return jnp.sum(jnp.round(inputs), -1).astype(jnp.int32)


@pytest.mark.parametrize("family", [_Summed(), _Integer()])
def test_a_family_per_example_of_another_shape_or_dtype_is_refused(family):
    # A scalar (the sum over examples) gave a value and gradient 12 times the
    # mean's beside the mean's curvature; integers gave a zero gradient.
    x = jnp.ones((12, 3))
    with pytest.raises(ValueError, match=r"must return one real loss per example"):
        ef.register_loss(family, x, 2 * x)
    assert ef.register_loss(ef.losses.Gaussian(), x, 2 * x) == 1.5


class _NarrowSample(ef.losses.Gaussian):
    def sample(self, key, inputs):  # one column, which broadcasts against two
        return jax.random.normal(key, inputs.shape[:-1] + (1,), inputs.dtype)


@pytest.mark.parametrize("samples", [1, 3])
def test_a_family_sample_of_another_shape_is_refused(samples):
    # Targets of shape (N, 1) for (N, 2) inputs broadcast in `per_example`: the
    # Monte-Carlo Fisher came out of other gradients, with no error.
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0), dtype=jnp.float64)
    x, t = jnp.ones((5, 3)), jnp.zeros((5, 2))
    key = jax.random.key(1)

    def loss_fn(family):
        return lambda m, b: ef.register_loss(family, jax.vmap(m)(b[0]), b[1])

    kwargs = dict(estimator=ef.FisherMC(samples=samples), structure=ef.Dense(), key=key)
    with pytest.raises(ValueError, match=r"`_NarrowSample.sample` drew targets"):
        ef.curvature(loss_fn(_NarrowSample()), model, (x, t), **kwargs)
    fisher = ef.curvature(loss_fn(ef.losses.Gaussian()), model, (x, t), **kwargs)
    assert jnp.all(jnp.isfinite(fisher.as_matrix()))


class _SamplesWithoutKey(ef.AbstractEstimator):
    needs_key = False  # wrong: `output_vectors` samples
    splits_positions = False

    def output_vectors(self, loss, key):
        targets = loss.family.sample(key, loss.inputs)
        g = loss.family.output_gradient(loss.inputs, targets)
        return (g * jnp.sqrt(loss.weights())[..., None])[None]

    def example_vectors(self, vectors):
        return vectors

    def batch_vectors(self, vectors, axis):
        return ef.EmpiricalFisher().batch_vectors(vectors, axis)


def test_an_estimator_that_samples_without_needs_key_is_told_to_declare_it():
    # JAX's "unexpected PRNG key type <class 'NoneType'>" named neither the
    # estimator nor `needs_key`.
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0), dtype=jnp.float64)
    batch = (jnp.ones((5, 3)), jnp.zeros((5, 2)))

    def loss_fn(m, b):
        return ef.squared_error(jax.vmap(m)(b[0]), b[1])

    kwargs = dict(estimator=_SamplesWithoutKey(), structure=ef.Dense())
    with pytest.raises(TypeError, match=r"`_SamplesWithoutKey.needs_key` is False"):
        ef.curvature(loss_fn, model, batch, **kwargs)
    curv = ef.curvature(loss_fn, model, batch, key=jax.random.key(1), **kwargs)
    assert curv.as_matrix().shape == (26, 26)


class _ReturnsMatrix(ef.optim.AbstractDamping):
    def precompute(self, block, damping):
        b = block.as_matrix()
        return jnp.linalg.inv(b + damping * jnp.eye(b.shape[0], dtype=b.dtype))


class _OtherParameters(ef.optim.AbstractDamping):
    def precompute(self, block, damping):
        return ef.blocks.DiagonalBlock((jnp.ones(3),))


@pytest.mark.parametrize("variant", [_ReturnsMatrix(), _OtherParameters()])
def test_a_damping_variant_returning_no_block_of_the_parameters_is_named(variant):
    # A matrix was blamed on `Curvature.map_blocks`, a block of other parameters on
    # the gradients' `where=`; neither named `precompute`.
    model = eqx.nn.MLP(4, 3, 5, 1, key=jax.random.key(0), dtype=jnp.float64)
    batch = (jax.random.normal(jax.random.key(1), (10, 4)), jnp.arange(10) % 3)

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC())
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = ef.optim.kfac_preconditioner(like=curv, damping=0.1, damping_variant=variant)
    name = type(variant).__name__
    with pytest.raises(TypeError, match=rf"`{name}.precompute\(block, damping\)` must"):
        opt.update(params, opt.init(params), params, curvature=curv)


class _Float32Full(ef.AbstractStructure):
    steps_alike = True

    def groups(self, candidates, model):
        return candidates

    def needs(self, group):
        return ef.Needs(examples=True)

    def block(self, group, statistics):
        matrix = statistics.full().matrix.astype(jnp.float32)
        return ef.blocks.Full(matrix, structure=statistics.shapes)


def test_a_structure_block_narrower_than_its_statistics_is_refused():
    # A float32 block of float64 statistics was accepted (and the curvature reported
    # float64): its entries were rounded at 1e-8, silently.
    model = eqx.nn.MLP(4, 3, 5, 1, key=jax.random.key(0), dtype=jnp.float64)
    batch = (jax.random.normal(jax.random.key(1), (10, 4)), jnp.arange(10) % 3)

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    with pytest.raises(TypeError, match=r"a block holding float32 arrays, narrower"):
        ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=_Float32Full()
        )


class _DropsACoordinate(ef.AbstractEstimator):
    needs_key = False
    splits_positions = False

    def output_vectors(self, loss, key):
        g = loss.family.output_gradient(loss.inputs, loss.targets)
        return (g * jnp.sqrt(loss.weights())[..., None])[None]

    def example_vectors(self, vectors):
        return vectors[..., :-1]

    def batch_vectors(self, vectors, axis):
        return vectors[..., :-1]


@pytest.mark.parametrize(
    "examples", [ef.IndependentExamples(), ef.InteractingExamples()]
)
def test_an_estimator_returning_vectors_of_another_shape_is_named(examples):
    # JAX's "unexpected JAX type ... for argument to VJP function" named neither
    # the estimator nor the method.
    model = eqx.nn.MLP(4, 3, 5, 1, key=jax.random.key(0), dtype=jnp.float64)
    batch = (jax.random.normal(jax.random.key(1), (10, 4)), jnp.arange(10) % 3)

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    method = "example" if examples == ef.IndependentExamples() else "batch"
    with pytest.raises(ValueError, match=rf"`_DropsACoordinate.{method}_vectors` must"):
        ef.curvature(
            loss_fn,
            model,
            batch,
            estimator=_DropsACoordinate(),
            structure=ef.Dense(),
            examples=examples,
        )
