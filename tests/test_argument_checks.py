"""Ordinary mistakes that passed silently, or failed deep inside JAX, optax or
Equinox (the third audit): each now gives the right answer or an error that names
the argument and the fix."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef
from eqfisher import optim

from .optim_problem import VGC, like, loss_fn, problem


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _laplace():
    return ef.laplace.fit(
        loss_fn, *problem(), likelihood="classification", structure=ef.KFAC()
    )


@pytest.mark.parametrize(
    "name,value",
    [
        ("weight_decay", float("nan")),  # a NaN model after a few steps
        ("weight_decay", -1.0),
        ("momentum", float("nan")),
        ("momentum", 2.0),
    ],
)
def test_kfac_momentum_and_weight_decay_are_checked(unchecked, name, value):
    with pytest.raises(ValueError, match=rf"kfac\(\.\.\., {name}=\.\.\.\)"):
        optim.kfac(0.1, like=like(), **{name: value})


@pytest.mark.parametrize("value", ["1e-2", jnp.full(2, 1e-2), True])
def test_hyperparameters_must_be_numbers(unchecked, value):
    # "1e-2" passed `float` and failed in numpy at the first step; a vector
    # failed in jax's scalar conversion.
    with pytest.raises(TypeError, match=r"learning_rate=\.\.\.\)`: a real number"):
        optim.kfac(value, like=like())


@pytest.mark.parametrize(
    "kwargs, off",
    [
        (dict(momentum=None), True),  # optax's "no momentum"
        (dict(weight_decay=None), True),
        (dict(damping=None), False),
        (dict(decay=None), False),
    ],
)
def test_none_for_a_number_is_named(unchecked, kwargs, off):
    # Python's "float() argument must be a string or a real number, not
    # 'NoneType'" before, naming no argument.
    (name,) = kwargs
    match = rf"{name}=\.\.\.\)`: a real number.*got None"
    with pytest.raises(
        TypeError, match=match + (r" \(0 switches it off\)" if off else r"\.$")
    ):
        optim.kfac(0.1, like=like(), **kwargs)
    with pytest.raises(TypeError, match=r"learning_rate=\.\.\.\)`: a real number"):
        optim.kfac_preconditioner(like=like(), learning_rate=None)
    with pytest.raises(TypeError, match=r"initial_damping=\.\.\.\)`: a real number"):
        optim.kfac_adaptive(like=like(), initial_damping=None)


def test_update_and_init_name_what_is_not_a_gradient_or_parameter(unchecked):
    model, batch = problem()
    opt = optim.kfac(0.1, like=like())
    state = opt.init(_params(model))
    _, grads, curv = VGC(model, batch)
    with pytest.raises(TypeError, match="`updates` must hold floating-point arrays"):
        opt.update(model, state, _params(model), curvature=curv)
    # `eqx.is_array` keeps integer leaves: named, where the step said only that
    # the state was not the optimiser's.
    counted = (_params(model), jnp.arange(3))
    with pytest.raises(TypeError, match=r"`params` must hold floating-point.*\[1\]"):
        optim.kfac(0.1, like=like()).init(counted)


def test_where_takes_an_optax_mask_and_names_by_path_for_a_string(unchecked):
    model, batch = problem()
    mask = ef.filters.optax_mask(model, ef.filters.by_path("layers[1].*"))

    def last(where):
        return ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense(), where=where
        ).as_matrix()

    # `None` at the activation (not a parameter) is read as False.
    np.testing.assert_array_equal(last(mask), last(ef.filters.by_path("layers[1].*")))
    with pytest.raises(TypeError, match=r"by_path\('layers\[1\]\.\*'\)"):
        last("layers[1].*")


def test_a_state_or_like_of_another_dtype_is_named():
    model, batch = problem()  # float64
    opt = optim.kfac(0.1, like=like())
    step = optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=ef.KFAC())
    state = opt.init(_params(model))
    cast = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        state,
    )
    with pytest.raises(ValueError, match="dtypes differ: float32 in the state's"):
        step(model, cast, batch)
    single = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, model
    )
    x, y = batch
    like32 = optim.curvature_like(VGC, single, (x.astype(jnp.float32), y))
    opt32 = optim.kfac(0.1, like=like32)
    step32 = optim.kfac_step(loss_fn, opt32, estimator=ef.GGN(), structure=ef.KFAC())
    with pytest.raises(ValueError, match="dtypes differ: float32 in `like`"):
        step32(model, opt32.init(_params(model)), batch)


@pytest.mark.parametrize("value", [float("nan"), "1", -1.0, 0])
def test_max_gib_is_a_positive_number(unchecked, value):
    # NaN turned the memory guard off; "1" failed in a comparison.
    with pytest.raises(ValueError, match=r"Dense\(max_gib=\.\.\.\)`: a positive"):
        ef.Dense(max_gib=value)
    model, batch = problem()
    curv = VGC(model, batch)[2]
    with pytest.raises(ValueError, match=r"as_matrix\(max_gib=\.\.\.\)`: a positive"):
        curv.as_matrix(max_gib=value)


def test_configure_as_a_statement_takes_effect():
    # It was a generator context manager: called without `with` it did nothing.
    with ef.configure(max_unroll=7):
        ef.configure(max_unroll=9)
        assert ef.current_config().max_unroll == 9
    assert ef.current_config().max_unroll == 128  # the block restores


@pytest.mark.parametrize(
    "make",
    [
        lambda m: ef.FisherMC(samples=m),
        lambda m: ef.KFAC(max_factor_dim=m),
        lambda m: ef.spectral.Hutchinson(matvecs=m),
        lambda m: ef.spectral.top_eigenpairs(
            ef.ggn_operator(loss_fn, *problem()), m, key=jax.random.key(0)
        ),
        # These said "must be a positive int, got np.int64(4)" (or a `JitTracer`,
        # under the function's own `jit`) without the fix.
        lambda m: optim.kfac(1e-2, like=like(), inverse_every=m),
        lambda m: optim.kfac_adaptive(like=like(), inverse_every=m),
        lambda m: optim.FactoredTikhonov(max_inverse_dim=m),
        lambda m: _laplace().sample(jax.random.key(0), m),
        lambda m: ef.laplace.predictive_samples(
            _laplace(), problem()[1][0][:2], jax.random.key(0), m
        ),
        lambda m: ef.laplace.optimize_hyperparameters(_laplace(), steps=m),
        lambda m: ef.laplace.expected_calibration_error(
            jnp.full((4, 2), 0.5), jnp.arange(4) % 2, bins=m
        ),
    ],
    ids=[
        "samples",
        "max_factor_dim",
        "matvecs",
        "k",
        "inverse_every",
        "adaptive-inverse_every",
        "max_inverse_dim",
        "num_samples",
        "predictive-num_samples",
        "steps",
        "bins",
    ],
)
def test_a_numpy_integer_count_is_told_to_be_a_python_int(unchecked, make):
    # It said only "must be an integer ..., got np.int64(4)" (for `k`, got a
    # traced array).
    del unchecked
    with pytest.raises(ValueError, match=r"pass a Python int, `int\(...\)`"):
        make(np.int64(4))


def test_a_where_of_boolean_arrays_says_it_selects_whole_leaves(unchecked):
    # `eqx.filter` called the user's NumPy array traced under `jit`.
    del unchecked
    model, batch = problem()
    spec = jax.tree_util.tree_map(
        lambda p: False, eqx.filter(model, eqx.is_inexact_array)
    )
    chosen = np.zeros(model.layers[1].weight.shape, bool)
    spec = eqx.tree_at(lambda s: s.layers[1].weight, spec, chosen)
    with pytest.raises(ValueError, match=r"holds an array at .layers\[1\].weight"):
        ef.curvature(
            loss_fn, model, batch, estimator=ef.GGN(), structure=ef.Dense(), where=spec
        )


def test_whole_numbers_are_taken_where_a_float_is_annotated():
    """The annotations said `float`: under jaxtyping's checking (the test
    suite's, or a user's import hook) an int learning rate, damping, weight decay
    or GiB limit was a `TypeCheckError`, though the library takes it."""
    curv = like()
    params = _params(problem()[0])
    pairs = [
        (
            optim.kfac(1, like=curv, weight_decay=0, graft=None, norm_constraint=1),
            optim.kfac(
                1.0, like=curv, weight_decay=0.0, graft=None, norm_constraint=1.0
            ),
        ),
        (
            optim.kfac_adaptive(like=curv, initial_damping=1),
            optim.kfac_adaptive(like=curv, initial_damping=1.0),
        ),
    ]
    for whole, real in pairs:
        a, b = whole.init(params), real.init(params)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    assert ef.Dense(max_gib=2).max_gib == 2
    quadrature = ef.spectral.Quadrature(
        nodes=jnp.arange(1.0, 11.0)[None], weights=jnp.full((1, 10), 0.1)
    )
    grid, density = quadrature.density(kappa=3, margin=0)
    assert grid.shape == density.shape == (1024,)


@pytest.mark.parametrize(
    "build, error, words",
    [
        (lambda: ef.IndependentExamples(axis="0"), TypeError, "example axis"),
        (lambda: ef.InteractingExamples(axis=None), TypeError, "example axis"),
        (lambda: ef.filters.by_path(3), TypeError, "glob string"),
        (
            lambda: ef.register_loss("categorical", jnp.zeros((2, 3)), jnp.zeros(2)),
            TypeError,
            "must be a loss family",
        ),
        (
            lambda: ef.spectral.Quadrature(
                nodes=jnp.ones((1, 10)), weights=jnp.ones((1, 9))
            ),
            ValueError,
            r"\(repeats, iterations\)",
        ),
        (
            lambda: ef.laplace.softmax_average(jnp.zeros((2, 3))),
            ValueError,
            r"\(samples, batch, classes\)",
        ),
        (
            lambda: ef.blocks.DiagonalBlock((jnp.array([-1.0, 2.0, 3.0]),)),
            ValueError,
            "non-negative",
        ),
    ],
    ids=[
        "axis",
        "interacting-axis",
        "by_path",
        "family",
        "quadrature",
        "average",
        "negative-diagonal",
    ],
)
def test_arguments_checked_where_they_are_given(unchecked, build, error, words):
    """Each failed later, naming nothing (`'<' not supported between str and
    int`, `'int' object has no attribute 'removeprefix'`, a broadcasting error),
    or gave a silent answer (`softmax_average` of one sample averaged the inputs;
    a negative diagonal gave NaN log-determinants)."""
    with pytest.raises(error, match=words):
        build()


@pytest.mark.parametrize(
    "call",
    [
        lambda: ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), has_aux="no"
        ),
        lambda: ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), surrogate=1
        ),
        lambda: ef.find_layers(loss_fn, *problem(), strict="no"),
    ],
    ids=["has_aux", "surrogate", "strict"],
)
def test_flags_must_be_bools(unchecked, call):
    """`has_aux="no"` was read as True (as `kfac_step` already refused)."""
    with pytest.raises(TypeError, match="True or False"):
        call()


def test_losses_exports_its_documented_names():
    import eqfisher.losses as losses

    assert "loss_tag_p" not in losses.__all__
    assert {"Categorical", "register_loss", "squared_error"} <= set(losses.__all__)
