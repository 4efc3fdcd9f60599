"""Conv K-FAC input factors computed from chunks of examples (never the whole patch
matrix) agree with the explicit patches, for every convolution layout the tracer
accepts."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqfisher as ef


F64 = jnp.float64


class Conv(eqx.Module):
    kernel: jax.Array
    bias: jax.Array
    head: eqx.nn.Linear
    strides: tuple = eqx.field(static=True)
    padding: object = eqx.field(static=True)
    dilation: tuple = eqx.field(static=True)
    dn: tuple = eqx.field(static=True)

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(
            x,
            self.kernel,
            self.strides,
            self.padding,
            rhs_dilation=self.dilation,
            dimension_numbers=self.dn,
        )
        feature = self.dn[2].index("C")
        shape = [1] * y.ndim
        shape[feature] = -1
        y = jnp.tanh(y + self.bias.reshape(shape))
        return jax.vmap(self.head)(y.reshape(y.shape[0], -1))


CONFIGS = {
    "2d-same": dict(spatial=(6, 5), k=(3, 3), strides=(1, 1), padding="SAME"),
    "2d-stride": dict(spatial=(7, 6), k=(3, 2), strides=(2, 3), padding="VALID"),
    "2d-dilated": dict(
        spatial=(7, 7), k=(2, 3), strides=(1, 2), padding=((1, 2), (0, 1)), dil=(2, 1)
    ),
    "1d": dict(spatial=(9,), k=(4,), strides=(2,), padding="SAME"),
    "3d": dict(spatial=(4, 5, 3), k=(2, 3, 2), strides=(1, 1, 2), padding="SAME"),
    "nhwc": dict(spatial=(5, 6), k=(3, 3), strides=(1, 1), padding="SAME", nhwc=True),
}


def _model_and_batch(cfg):
    nsp = len(cfg["spatial"])
    letters = "HWD"[:nsp]
    nhwc = cfg.get("nhwc", False)
    lhs = ("N" + letters + "C") if nhwc else ("NC" + letters)
    rhs = (letters + "IO") if nhwc else ("OI" + letters)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    c_in, c_out, n = 3, 4, 3
    sizes = {"O": c_out, "I": c_in, **dict(zip(letters, cfg["k"]))}
    k_shape = [sizes[a] for a in rhs]
    x_sizes = {"N": n, "C": c_in, **dict(zip(letters, cfg["spatial"]))}
    x = jax.random.normal(k1, [x_sizes[a] for a in lhs], F64)
    kernel = 0.3 * jax.random.normal(k2, k_shape, F64)
    dil = cfg.get("dil", (1,) * nsp)
    out = jax.eval_shape(
        lambda: jax.lax.conv_general_dilated(
            x,
            kernel,
            cfg["strides"],
            cfg["padding"],
            rhs_dilation=dil,
            dimension_numbers=(lhs, rhs, lhs),
        )
    )
    model = Conv(
        kernel,
        0.1 * jax.random.normal(k3, (c_out,), F64),
        eqx.nn.Linear(out.size // n, 2, dtype=F64, key=k4),
        cfg["strides"],
        cfg["padding"],
        dil,
        (lhs, rhs, lhs),
    )
    y = jnp.array([0, 1, 1])
    return model, (x, y)


def _locations(model, batch) -> int:
    """Output locations of the conv per example."""
    out = jax.eval_shape(lambda: model.head.weight)
    return out.shape[1] // 4


def _loss(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(model(x), y)


# Chunks of one and of two examples are checked in one test, against one explicit
# computation (a separate test each would compute it again, on another worker under
# pytest-xdist).
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_patches_match_explicit_patches(name, sharing):
    model, batch = _model_and_batch(CONFIGS[name])
    structure = ef.KFAC(weight_sharing=sharing)

    def factors():
        # A fresh function each time: a new trace, not a cached compilation.
        curv = ef.curvature(
            lambda m, b: _loss(m, b),
            model,
            batch,
            estimator=ef.GGN(),
            structure=structure,
        )
        block = curv.blocks["kernel+bias"]
        return np.asarray(block.a), np.asarray(block.g)

    a_explicit, g_explicit = factors()
    # Three examples in chunks of one, or of two (the last padded with a zero one).
    per_example = 3 * int(np.prod(CONFIGS[name]["k"])) * _locations(model, batch)
    for per_chunk in (1, 2):
        with ef.configure(max_patch_elements=per_chunk * per_example):
            a_moments, g_moments = factors()
        np.testing.assert_allclose(
            a_moments, a_explicit, rtol=1e-12, atol=1e-14, err_msg=f"{per_chunk=}"
        )
        np.testing.assert_allclose(
            g_moments, g_explicit, rtol=1e-12, atol=1e-14, err_msg=f"{per_chunk=}"
        )
        assert a_moments.shape[0] == 3 * np.prod(CONFIGS[name]["k"]) + 1
