import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from eqfisher import stop_hessian


MODES = {
    "fwd-fwd": lambda f: jax.jacfwd(jax.jacfwd(f)),
    "fwd-rev": lambda f: jax.jacfwd(jax.jacrev(f)),
    "rev-fwd": lambda f: jax.jacrev(jax.jacfwd(f)),
    "rev-rev": lambda f: jax.jacrev(jax.jacrev(f)),
}


def f(x):
    return jnp.sin(jnp.cos(x))


def f_prime(x):
    return -jnp.cos(jnp.cos(x)) * jnp.sin(x)


@pytest.mark.parametrize("mode", MODES)
def test_seed_example(mode):
    # h = ½ f², h'' = f'² + f f''; stop_hessian drops the f f'' term.
    h = lambda x: 0.5 * stop_hessian(f)(x) ** 2
    x = jnp.arange(4.0)
    got = jax.vmap(MODES[mode](h))(x)
    np.testing.assert_allclose(got, f_prime(x) ** 2, rtol=0, atol=1e-12)
    full = jax.vmap(MODES[mode](lambda x: 0.5 * f(x) ** 2))(x)
    assert not np.allclose(full, got)
    # The first derivative is kept.
    np.testing.assert_allclose(jax.vmap(jax.grad(h))(x), f(x) * f_prime(x), atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
def test_python_scalars(mode):
    # A Python float is weakly typed under `jax.grad`; it must work like an array.
    h = lambda x: 0.5 * stop_hessian(f)(x) ** 2
    got = MODES[mode](h)(0.7)
    np.testing.assert_allclose(got, f_prime(0.7) ** 2, rtol=1e-12)
    np.testing.assert_allclose(jax.grad(h)(0.7), f(0.7) * f_prime(0.7), rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_closure(mode):
    # Arrays `fn` closes over, here the differentiated `x`, are inputs too.
    x = jnp.arange(4.0)
    h = lambda x: 0.5 * stop_hessian(lambda y: f(x) * y)(jnp.array(1.0)) ** 2
    got = jax.vmap(MODES[mode](h))(x)
    np.testing.assert_allclose(got, f_prime(x) ** 2, rtol=0, atol=1e-12)


def test_higher_derivatives_dropped():
    # h = f³/6: with every derivative of f beyond the first dropped, h''' = f'³.
    h = lambda x: stop_hessian(f)(x) ** 3 / 6
    x = jnp.arange(4.0)
    got = jax.vmap(jax.jacfwd(jax.jacrev(jax.grad(h))))(x)
    np.testing.assert_allclose(got, f_prime(x) ** 3, rtol=0, atol=1e-12)


def pytree_fn(inputs, *, power):
    a, b = inputs["a"], inputs["b"]
    return jnp.sin(a) * b[0], (
        jnp.cumsum(b * a[1]) ** power,
        inputs["n"].astype(b.dtype) * b,
    )


INPUTS = {
    "a": jnp.array([0.3, -1.2]),
    "b": jnp.array([0.7, 1.5, -0.4]),
    "n": jnp.array(3),
}


@pytest.mark.parametrize("mode", MODES)
def test_pytree_in_out(mode):
    # Loss ½‖y‖² of a dict → tuple function: its stop_hessian Hessian is JᵀJ.
    flat, unravel = ravel_pytree({k: INPUTS[k] for k in ("a", "b")})
    n = INPUTS["n"]
    out_flat = lambda v: ravel_pytree(pytree_fn({**unravel(v), "n": n}, power=2))[0]
    jac = jax.jacfwd(out_flat)(flat)

    def loss(v):
        out = stop_hessian(pytree_fn)({**unravel(v), "n": n}, power=2)
        return 0.5 * sum(jnp.sum(y**2) for y in jax.tree_util.tree_leaves(out))

    np.testing.assert_allclose(MODES[mode](loss)(flat), jac.T @ jac, atol=1e-12)


def test_first_derivatives():
    primals = ({k: INPUTS[k] for k in ("a", "b")},)
    tangents = ({"a": jnp.array([1.0, 2.0]), "b": jnp.array([-1.0, 0.5, 3.0])},)
    fn = lambda d: pytree_fn({**d, "n": jnp.array(2)}, power=3)
    # tree_map also checks that the output structures agree.
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-14)
    got = jax.jvp(stop_hessian(fn), primals, tangents)
    jax.tree_util.tree_map(close, got, jax.jvp(fn, primals, tangents))
    scalar = lambda g: lambda d: jnp.sum(g(d)[1][0])
    got = jax.grad(scalar(stop_hessian(fn)))(*primals)
    jax.tree_util.tree_map(close, got, jax.grad(scalar(fn))(*primals))


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


@pytest.fixture(scope="module")
def mlp_problem():
    mkey, xkey, ykey = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(3, 4, 5, 2, activation=jnp.tanh, key=mkey)
    model = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model
    )
    x = jax.random.normal(xkey, (6, 3))
    labels = jax.random.randint(ykey, (6,), 0, 4)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    rebuild = lambda v: eqx.combine(unravel(v), static)
    outputs = lambda v: jax.vmap(rebuild(v))(x)
    # Dense GGN = Jᵀ H J, J = d outputs / d params, H = d² loss / d outputs².
    out = outputs(flat)
    jac = jax.jit(jax.jacfwd(outputs))(flat).reshape(out.size, flat.size)
    hess = jax.hessian(lambda o: cross_entropy(o.reshape(out.shape), labels))(
        out.ravel()
    )
    ggn = jac.T @ hess @ jac
    return flat, rebuild, outputs, x, labels, ggn


@pytest.mark.parametrize("mode", [*MODES, "hessian"])
def test_ggn_function(mlp_problem, mode):
    flat, _, outputs, _, labels, ggn = mlp_problem
    loss = lambda v: cross_entropy(stop_hessian(outputs)(v), labels)
    hessian = jax.hessian if mode == "hessian" else MODES[mode]
    np.testing.assert_allclose(
        jax.jit(hessian(loss))(flat), ggn, rtol=1e-10, atol=1e-10
    )
    full = jax.jit(jax.hessian(lambda v: cross_entropy(outputs(v), labels)))(flat)
    assert not np.allclose(full, ggn, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [*MODES, "hessian"])
def test_ggn_module(mlp_problem, mode):
    # The model's parameters are inputs of `stop_hessian(model)` too.
    flat, rebuild, _, x, labels, ggn = mlp_problem
    loss = lambda v: cross_entropy(jax.vmap(stop_hessian(rebuild(v)))(x), labels)
    hessian = jax.hessian if mode == "hessian" else MODES[mode]
    # Eager here; jitted in test_ggn_function and test_jit_vmap.
    np.testing.assert_allclose(hessian(loss)(flat), ggn, rtol=1e-10, atol=1e-10)


def test_jit_vmap(mlp_problem):
    flat, rebuild, _, x, labels, ggn = mlp_problem
    model = rebuild(flat)
    wrapped = stop_hessian(model)
    # A Module: its leaves are the model's, so filtered transformations see them.
    assert eqx.tree_equal(
        eqx.filter(wrapped, eqx.is_array).fn, eqx.filter(model, eqx.is_array)
    )
    np.testing.assert_allclose(eqx.filter_jit(wrapped)(x[0]), model(x[0]), rtol=1e-14)
    np.testing.assert_allclose(jax.vmap(wrapped)(x), jax.vmap(model)(x), rtol=1e-14)

    @jax.jit
    def ggn_jit(v, x, labels):
        loss = lambda v: cross_entropy(jax.vmap(stop_hessian(rebuild(v)))(x), labels)
        return jax.hessian(loss)(v)

    np.testing.assert_allclose(ggn_jit(flat, x, labels), ggn, rtol=1e-10, atol=1e-10)
    # Per-example GGNs under vmap average to the batch GGN.
    per_example = jax.vmap(ggn_jit, in_axes=(None, 0, 0))(
        flat, x[:, None], labels[:, None]
    )
    np.testing.assert_allclose(per_example.mean(0), ggn, rtol=1e-10, atol=1e-10)


def test_not_callable():
    with pytest.raises(TypeError, match="fn"):
        stop_hessian(jnp.ones(3))
