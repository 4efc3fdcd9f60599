"""`eqfisher.PerLayer`: different structures for different layers in one curvature,
against dense float64 references written without eqfisher (`kfac_reference.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef

from .helpers import ravelled, tree_allclose
from .kfac_reference import (
    as_matrix,
    cross_entropy,
    dense_ggn,
    kfac_factors,
    kronecker_dense,
    layer_slice,
)


F64 = jnp.float64
N, IN, HIDDEN, OUT = 7, 3, 4, 5
by_path = ef.filters.by_path


def _problem():
    model = eqx.nn.MLP(
        IN, OUT, HIDDEN, 2, activation=jnp.tanh, dtype=F64, key=jr.key(0)
    )
    kx, ky = jr.split(jr.key(1))
    return model, (jr.normal(kx, (N, IN), F64), jr.randint(ky, (N,), 0, OUT))


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


# Each case: the structure, and the reference as (layers, kind) pairs: "full" is the
# dense GGN over those layers' parameters together, "diagonal" its diagonal, "kfac"
# the Kronecker block G ⊗ A of one layer.
CASES = {
    "diagonal_head_full_first": (
        ef.PerLayer(
            (by_path("layers[2].*"), ef.Diagonal()),
            (by_path("layers[0].*"), ef.BlockDiagonal()),
            default=ef.KFAC(),
        ),
        [((0,), "full"), ((1,), "kfac"), ((2,), "diagonal")],
        {"layers[0]": ef.blocks.Full, "layers[1]": ef.blocks.KroneckerFactored},
    ),
    "dense_over_two_layers": (
        ef.PerLayer(
            (by_path("layers[0].*") | by_path("layers[2].*"), ef.Dense()),
            default=ef.KFAC(),
        ),
        [((0, 2), "full"), ((1,), "kfac")],
        {"all": ef.blocks.Full, "layers[1]": ef.blocks.KroneckerFactored},
    ),
    "kfac_part_diagonal_default": (
        ef.PerLayer((by_path("layers[1].*"), ef.KFAC()), default=ef.Diagonal()),
        [((0,), "diagonal"), ((1,), "kfac"), ((2,), "diagonal")],
        {"layers[2]": ef.blocks.DiagonalBlock},
    ),
}


def reference(model, batch, parts) -> np.ndarray:
    x, y = batch
    ggn = dense_ggn(model, x, y)
    out = np.zeros_like(ggn)
    for layers, kind in parts:
        idx = np.concatenate([layer_slice(model, k) for k in layers])
        if kind == "full":
            out[np.ix_(idx, idx)] = ggn[np.ix_(idx, idx)]
        elif kind == "diagonal":
            out[idx, idx] = np.diag(ggn)[idx]
        else:
            (k,) = layers
            out[np.ix_(idx, idx)] = kronecker_dense(*kfac_factors(model, x, y, k))
    return out


@pytest.mark.parametrize("case", CASES)
def test_curvature_matches_references(case):
    structure, parts, types = CASES[case]
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    for name, cls in types.items():
        assert type(curv.blocks[name]) is cls
    np.testing.assert_allclose(
        as_matrix(curv), reference(model, batch, parts), rtol=1e-10, atol=1e-12
    )


def test_value_grad_and_curvature():
    structure, parts, _ = CASES["diagonal_head_full_first"]
    model, batch = _problem()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=structure)
    loss, grads, curv = vgc(model, batch)

    flat, rebuild = ravelled(model)
    mean_loss = lambda f: jnp.mean(
        jax.vmap(cross_entropy)(jax.vmap(rebuild(f))(batch[0]), batch[1])
    )
    np.testing.assert_allclose(loss, mean_loss(flat), rtol=1e-12)
    np.testing.assert_allclose(
        jax.flatten_util.ravel_pytree(grads)[0], jax.grad(mean_loss)(flat), rtol=1e-10
    )
    np.testing.assert_allclose(
        as_matrix(curv), reference(model, batch, parts), rtol=1e-10, atol=1e-12
    )


def test_kfac_step_is_the_damped_newton_step_of_the_reference():
    # With exact damping and no norm constraint or momentum, K-FAC's first step is
    # −lr (C + λI)⁻¹ g, C the first curvature estimate.
    structure, parts, _ = CASES["dense_over_two_layers"]
    model, batch = _problem()
    lr, lam = 0.5, 0.1
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=ef.GGN(), structure=structure)
    opt = ef.optim.kfac(
        lr,
        like=ef.optim.curvature_like(vgc, model, batch),
        damping=lam,
        momentum=0.0,
        damping_variant=ef.optim.Tikhonov(),
        graft=None,  # the plain damped Newton step
    )
    step = ef.optim.kfac_step(loss_fn, opt, estimator=ef.GGN(), structure=structure)
    params = eqx.filter(model, eqx.is_inexact_array)
    new, _, _ = step(model, opt.init(params), batch)

    flat, rebuild = ravelled(model)
    grad = jax.grad(
        lambda f: jnp.mean(
            jax.vmap(cross_entropy)(jax.vmap(rebuild(f))(batch[0]), batch[1])
        )
    )(flat)
    c = reference(model, batch, parts)
    expected = flat - lr * np.linalg.solve(c + lam * np.eye(c.shape[0]), grad)
    assert tree_allclose(ravelled(new)[0], expected, rtol=1e-9, atol=1e-12)


def test_a_layer_split_between_parts_is_refused():
    model, batch = _problem()
    structure = ef.PerLayer(
        (by_path("layers[0].bias"), ef.Diagonal()), default=ef.KFAC()
    )
    with pytest.raises(ValueError, match=r"`layers\[0\]`.*go to part 0 and `default`"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)


class _Affine(eqx.Module):
    V: jax.Array
    c: jax.Array

    def __call__(self, x):
        return x @ self.V + self.c


def test_the_split_layer_refusal_suggests_a_filter_that_selects_it():
    """A layer that is no submodule (`x @ self.V + self.c`, named `V+c`) was
    told to select `by_path('V+c.*')`, which selects nothing. The suggested
    filter, evaluated, selects the whole layer, and the curvature is built."""
    model = _Affine(jr.normal(jr.key(0), (2, 3), F64), jnp.zeros(3, F64))
    batch = (jr.normal(jr.key(1), (4, 2), F64), jnp.array([0, 1, 2, 0]))
    parts = (by_path("V"), ef.KFAC())
    with pytest.raises(ValueError, match="Select whole layers") as refusal:
        ef.curvature(
            loss_fn,
            model,
            batch,
            estimator=ef.GGN(),
            structure=ef.PerLayer(parts, default=ef.Diagonal()),
        )
    suggested = str(refusal.value).split("e.g. `")[1].split("`")[0]
    where = eval(suggested, {"eqfisher": ef})  # noqa: S307 (our own message)
    curv = ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.PerLayer((where, ef.KFAC()), default=ef.Diagonal()),
    )
    assert list(curv.blocks) == ["V+c"]
    assert curv.blocks["V+c"].as_matrix().shape == (9, 9)


def test_two_dense_parts_are_refused():
    model, batch = _problem()
    structure = ef.PerLayer(
        (by_path("layers[0].*"), ef.Dense()),
        (by_path("layers[1].*"), ef.Dense()),
        default=ef.KFAC(),
    )
    with pytest.raises(ValueError, match="at most one `Dense"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)


def test_a_part_selecting_nothing_is_refused():
    model, batch = _problem()
    structure = ef.PerLayer((by_path("head.*"), ef.Diagonal()), default=ef.KFAC())
    with pytest.raises(ValueError, match="PerLayer.*part 0"):
        ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)


def test_parts_must_be_pairs_of_filter_and_structure(unchecked):
    with pytest.raises(
        TypeError, match=r"part 0 must be a pair `\(where, structure\)`"
    ):
        ef.PerLayer((by_path("layers[0].*"), "diagonal"), default=ef.KFAC())
    # A filter alone, not in a pair: Python's "'_ByPath' object is not iterable".
    with pytest.raises(TypeError, match=r"part 0 must be a pair"):
        ef.PerLayer(by_path("layers[0].*"), default=ef.KFAC())
    with pytest.raises(TypeError, match="`default` must be a structure"):
        ef.PerLayer(default="kfac")
