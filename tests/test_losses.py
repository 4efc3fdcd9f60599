"""Registered losses against hand-written formulas, and their families."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef
from eqfisher.losses import Bernoulli, Categorical, Gaussian


F64 = jnp.float64
N, C = 6, 4


def _logits(seed=0, shape=(N, C)):
    return jr.normal(jr.key(seed), shape, F64)


def _int_labels(seed=1, shape=(N,)):
    return jr.randint(jr.key(seed), shape, 0, C)


def _probs(seed=2, shape=(N, C)):
    return jax.nn.softmax(jr.normal(jr.key(seed), shape, F64))


def _bits(seed=3, shape=(N, C)):
    return jr.bernoulli(jr.key(seed), 0.5, shape).astype(F64)


def _values(seed=4, shape=(N, C)):
    return jr.normal(jr.key(seed), shape, F64)


# Each case: (name, eqfisher loss, targets, hand-written per-example loss).
def _ce_int(z, y):
    return -jnp.log(jnp.exp(z[jnp.arange(z.shape[0]), y]) / jnp.sum(jnp.exp(z), 1))


def _ce_prob(z, p):
    return -jnp.sum(p * (z - jnp.log(jnp.sum(jnp.exp(z), 1, keepdims=True))), 1)


def _bce(z, t):
    s = 1 / (1 + jnp.exp(-z))
    return -jnp.sum(t * jnp.log(s) + (1 - t) * jnp.log(1 - s), 1)


def _sq(z, t):
    return 0.5 * jnp.sum((z - t) ** 2, 1)


CASES = [
    ("softmax_int", ef.softmax_cross_entropy, _int_labels(), _ce_int),
    ("softmax_prob", ef.softmax_cross_entropy, _probs(), _ce_prob),
    ("sigmoid", ef.sigmoid_cross_entropy, _bits(), _bce),
    ("squared", ef.squared_error, _values(), _sq),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,loss,targets,by_hand", CASES, ids=CASE_IDS)
def test_value_grad_hessian(name, loss, targets, by_hand):
    z = _logits()

    def ref(z):
        return jnp.mean(by_hand(z, targets))

    def ours(z):
        return loss(z, targets)

    np.testing.assert_allclose(ours(z), ref(z), rtol=1e-12)
    np.testing.assert_allclose(
        jax.grad(ours)(z), jax.grad(ref)(z), rtol=1e-10, atol=1e-14
    )
    np.testing.assert_allclose(
        jax.hessian(ours)(z), jax.hessian(ref)(z), rtol=1e-9, atol=1e-13
    )


@pytest.mark.parametrize("name,loss,targets,by_hand", CASES, ids=CASE_IDS)
def test_mask(name, loss, targets, by_hand):
    z = _logits()
    mask = jnp.array([1, 0, 1, 1, 0, 1], bool)
    expected = jnp.mean(by_hand(z[mask], targets[mask]))
    np.testing.assert_allclose(loss(z, targets, mask=mask), expected, rtol=1e-12)
    weights = jnp.linspace(0.5, 2.0, N, dtype=F64)
    weighted = jnp.sum(weights * by_hand(z, targets)) / jnp.sum(weights)
    np.testing.assert_allclose(loss(z, targets, mask=weights), weighted, rtol=1e-12)
    # Masked examples get no gradient.
    grad = jax.grad(lambda z: loss(z, targets, mask=mask))(z)
    np.testing.assert_array_equal(grad[~mask], 0.0)


@pytest.mark.parametrize("name,loss,targets,by_hand", CASES, ids=CASE_IDS)
def test_leading_axes(name, loss, targets, by_hand):
    # Every leading axis indexes examples: (2, 3, C) is the mean over 6 examples.
    z = _logits()
    t2 = targets.reshape((2, 3) + targets.shape[1:])
    np.testing.assert_allclose(
        loss(z.reshape(2, 3, C), t2), jnp.mean(by_hand(z, targets)), rtol=1e-12
    )


@pytest.mark.parametrize("name,loss,targets,by_hand", CASES, ids=CASE_IDS)
def test_transformations(name, loss, targets, by_hand):
    z = _logits()
    expected = jnp.mean(by_hand(z, targets))
    np.testing.assert_allclose(jax.jit(loss)(z, targets), expected, rtol=1e-12)
    np.testing.assert_allclose(eqx.filter_jit(loss)(z, targets), expected, rtol=1e-12)
    zs, ts = jnp.stack([z, 2 * z]), jnp.stack([targets, targets])
    batched = jax.vmap(loss)(zs, ts)
    np.testing.assert_allclose(
        batched,
        jnp.stack([expected, jnp.mean(by_hand(2 * z, targets))]),
        rtol=1e-12,
    )
    v = _values(seed=9)
    value, tangent = jax.jvp(lambda z: loss(z, targets), (z,), (v,))
    _, ref_tangent = jax.jvp(lambda z: jnp.mean(by_hand(z, targets)), (z,), (v,))
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-10)
    np.testing.assert_allclose(
        jax.jit(jax.grad(lambda z: loss(z, targets)))(z),
        jax.grad(lambda z: jnp.mean(by_hand(z, targets)))(z),
        rtol=1e-10,
        atol=1e-14,
    )


FAMILIES = [
    ("categorical", Categorical(), _int_labels()),
    ("categorical_prob", Categorical(), _probs()),
    ("bernoulli", Bernoulli(), _bits()),
    ("gaussian", Gaussian(), _values()),
]
FAMILY_IDS = [f[0] for f in FAMILIES]


@pytest.mark.parametrize("name,family,targets", FAMILIES, ids=FAMILY_IDS)
def test_sqrt_hessian(name, family, targets):
    z = _logits()
    s = family.sqrt_hessian(z)
    assert s.shape == (N, C, C)
    for n in range(N):
        tn = targets[n][None]
        hess = jax.hessian(lambda zn, tn=tn: family.per_example(zn[None], tn)[0])(z[n])
        np.testing.assert_allclose(s[n] @ s[n].T, hess, rtol=1e-10, atol=1e-14)
    v = _values(seed=5)
    hv = jnp.einsum("nij,nj->ni", jax.vmap(lambda zn: zn @ zn.T)(s), v)
    np.testing.assert_allclose(family.hessian_mv(z, v), hv, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name,family,targets", FAMILIES, ids=FAMILY_IDS)
def test_output_gradient(name, family, targets):
    z = _logits()
    grad = jax.grad(lambda z: jnp.sum(family.per_example(z, targets)))(z)
    np.testing.assert_allclose(family.output_gradient(z, targets), grad, rtol=1e-12)
    # Per-example: row n depends on example n only.
    row = jax.grad(lambda zn: family.per_example(zn[None], targets[2][None])[0])(z[2])
    np.testing.assert_allclose(family.output_gradient(z, targets)[2], row, rtol=1e-12)


SAMPLES = 20_000


@pytest.mark.parametrize(
    "name,family,mean_fn,var_fn",
    [
        (
            "categorical",
            Categorical(),
            lambda z: jax.nn.softmax(z),
            lambda z: jax.nn.softmax(z) * (1 - jax.nn.softmax(z)),
        ),
        (
            "bernoulli",
            Bernoulli(),
            lambda z: jax.nn.sigmoid(z),
            lambda z: jax.nn.sigmoid(z) * (1 - jax.nn.sigmoid(z)),
        ),
        ("gaussian", Gaussian(), lambda z: z, lambda z: jnp.ones_like(z)),
    ],
    ids=["categorical", "bernoulli", "gaussian"],
)
def test_sample(name, family, mean_fn, var_fn):
    z = _logits(shape=(3, C))
    keys = jr.split(jr.key(0), SAMPLES)
    draws = jax.vmap(lambda k: family.sample(k, z))(keys)
    if name == "categorical":
        assert draws.shape == (SAMPLES, 3)
        assert jnp.issubdtype(draws.dtype, jnp.integer)
        draws = jax.nn.one_hot(draws, C, dtype=F64)
    else:
        assert draws.shape == (SAMPLES, 3, C)
        assert draws.dtype == F64
    if name == "bernoulli":
        assert set(np.unique(draws).tolist()) <= {0.0, 1.0}
    # Five standard errors of the mean, per entry.
    tol = 5 * jnp.sqrt(var_fn(z) / SAMPLES)
    assert jnp.all(jnp.abs(jnp.mean(draws, 0) - mean_fn(z)) < tol)
    # The sampled targets are valid targets of the same loss.
    one = family.sample(jr.key(1), z)
    ef.register_loss(family, z, one)


def test_categorical_sample_masked_classes_and_float32():
    # A class of probability zero (logit -inf) is never drawn, and float32 logits
    # over a large vocabulary give ids in range (the inverse CDF's last bin).
    z = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf]], F64)
    keys = jr.split(jr.key(3), 4000)
    draws = jax.vmap(lambda k: Categorical().sample(k, z))(keys)
    assert set(np.unique(draws).tolist()) == {0, 2}
    frequency = float(jnp.mean(draws == 2))
    p = float(jax.nn.softmax(z)[0, 2])
    assert abs(frequency - p) < 5 * np.sqrt(p * (1 - p) / 4000)
    big = jr.normal(jr.key(4), (64, 50_000), jnp.float32) * 4
    ids = Categorical().sample(jr.key(5), big)
    assert ids.shape == (64,) and int(ids.min()) >= 0 and int(ids.max()) < 50_000
    # bfloat16 logits (4,096 equal classes): the upper half is drawn half the time.
    flat = jnp.zeros((1, 4096), jnp.bfloat16)
    keys = jr.split(jr.key(6), 2000)
    late = jax.vmap(lambda k: Categorical().sample(k, flat))(keys) >= 2048
    assert abs(float(jnp.mean(late)) - 0.5) < 5 * np.sqrt(0.25 / 2000)


def test_integer_labels_pick_by_select_with_masked_classes():
    # A class masked out with logit -inf: the labelled class's loss and its
    # gradient stay finite and exact (0 * -inf never enters), and the gradient
    # has no scatter (a loop over the examples on the CPU).
    z = jnp.array([[0.5, -jnp.inf, 2.0], [1.0, 0.0, -jnp.inf]], F64)
    labels = jnp.array([2, 0])

    def ours(z):
        return ef.softmax_cross_entropy(z, labels)

    p = jax.nn.softmax(z)
    np.testing.assert_allclose(
        ours(z), -jnp.mean(jnp.log(p[jnp.arange(2), labels])), rtol=1e-14
    )
    grad = jax.grad(ours)(z)
    expected = (p - jax.nn.one_hot(labels, 3, dtype=F64)) / 2
    np.testing.assert_allclose(grad, expected, rtol=1e-14, atol=1e-16)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(ours))(z))
    # Narrow label dtypes over many classes: class 256 is not label 0 in int8.
    wide = jr.normal(jr.key(7), (3, 300), F64)
    small = jnp.array([0, 127, 7], jnp.int8)
    np.testing.assert_allclose(
        ef.softmax_cross_entropy(wide, small),
        -jnp.mean(jax.nn.log_softmax(wide)[jnp.arange(3), small.astype(jnp.int32)]),
        rtol=1e-14,
    )


def test_registered_loss_weights():
    z, y = _logits(), _int_labels()
    mask = jnp.array([1.0, 0.0, 2.0, 1.0, 0.0, 1.0], F64)

    def loss_fn(z, batch):
        y, mask = batch
        return ef.softmax_cross_entropy(z, y, mask=mask)

    (loss,), _ = ef.loss_tags_vjp(loss_fn)(z, (y, mask))
    np.testing.assert_allclose(loss.weights(), mask / 5.0, rtol=1e-12)
    np.testing.assert_allclose(loss.value(), loss_fn(z, (y, mask)), rtol=1e-12)
    np.testing.assert_array_equal(loss.mask, mask)


# --- errors --------------------------------------------------------------------------


def test_checker_rejects_bad_inputs_first():
    with pytest.raises(TypeError):
        ef.softmax_cross_entropy(_int_labels()[:, None], _int_labels())
    with pytest.raises(TypeError):
        ef.squared_error(_logits(), _values(), mask=jnp.ones((N, C), F64))


def test_non_float_logits(unchecked):
    labels = _int_labels()
    with pytest.raises(TypeError, match="floating-point"):
        ef.softmax_cross_entropy(labels[:, None], labels)
    with pytest.raises(TypeError, match="floating-point"):
        ef.squared_error(jnp.ones((N, C), jnp.int32), _values())


@pytest.mark.parametrize(
    "loss,targets,match",
    [
        (ef.softmax_cross_entropy, _int_labels(shape=(N, 1)), "integer `labels`"),
        (ef.softmax_cross_entropy, _probs(shape=(N, C + 1)), "probability `labels`"),
        (ef.sigmoid_cross_entropy, _bits(shape=(N,)), "`targets`"),
        (ef.squared_error, _values(shape=(N, 1)), "`targets`"),
    ],
    ids=["softmax_int", "softmax_prob", "sigmoid", "squared"],
)
def test_wrong_target_shapes(unchecked, loss, targets, match):
    with pytest.raises(ValueError, match=match):
        loss(_logits(), targets)


def test_wrong_mask_shape(unchecked):
    with pytest.raises(ValueError, match="`mask`"):
        ef.squared_error(_logits(), _values(), mask=jnp.ones((N, C), F64))


def test_bool_labels_are_rejected():
    with pytest.raises(TypeError, match="integer class ids or float probabilities"):
        ef.register_loss(Categorical(), _logits(), jnp.ones(N, bool))


@pytest.mark.parametrize(
    "loss,targets",
    [
        (ef.softmax_cross_entropy, jnp.zeros((), jnp.int32)),
        (ef.sigmoid_cross_entropy, jnp.zeros(N, F64)),
        (ef.squared_error, jnp.zeros(N, F64)),
    ],
    ids=["softmax", "sigmoid", "squared"],
)
def test_one_dimensional_predictions(loss, targets):
    # One output per example, or one example's outputs: both fixes named.
    with pytest.raises(ValueError, match=r"outputs\[\.\.\., None\].*outputs\[None\]"):
        loss(jnp.zeros(N, F64), targets)


@pytest.mark.parametrize(
    "loss,targets",
    [
        (ef.softmax_cross_entropy, _probs().astype(jnp.complex128)),
        (ef.sigmoid_cross_entropy, _bits().astype(jnp.complex128)),
        (ef.squared_error, _values().astype(jnp.complex128) * (1 + 3j)),
    ],
    ids=["softmax", "sigmoid", "squared"],
)
def test_complex_targets_and_masks_are_refused(unchecked, loss, targets):
    # The imaginary part was dropped: targets 1+3j gave the loss of targets 1.
    with pytest.raises(TypeError, match="`targets` must be real"):
        loss(_logits(), targets)
    real = jnp.real(targets).astype(F64)
    with pytest.raises(TypeError, match="`mask` must be real"):
        loss(_logits(), real, mask=jnp.ones(N, jnp.complex128))


def test_sigmoid_targets_outside_zero_one_are_refused():
    # Targets of 2 make the loss unbounded below: no likelihood.
    targets = _bits().at[0, 0].set(2.0)
    with pytest.raises(ValueError, match=r"0/1 or probabilities in \[0, 1\].*Got 2.0"):
        ef.sigmoid_cross_entropy(_logits(), targets)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"probabilities in \[0, 1\]"):
        eqx.filter_jit(ef.sigmoid_cross_entropy)(_logits(), targets)
    # Allowed where the mask is 0; probabilities and integer or bool 0/1 pass.
    mask = jnp.ones(N, F64).at[0].set(0.0)
    assert jnp.isfinite(ef.sigmoid_cross_entropy(_logits(), targets, mask=mask))
    for ok in (_bits() * 0.5, _bits().astype(jnp.int32), _bits().astype(bool)):
        assert jnp.isfinite(jax.jit(ef.sigmoid_cross_entropy)(_logits(), ok))
