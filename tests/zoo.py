"""A zoo of models written the way people write them, with their expected layers.

Each `ZooEntry` has a `name`, a `model(key)` constructor, a `batch(key)` builder, a
`loss_fn(model, batch)` registering its loss with eqfisher, and the detection the
tracer must produce: `layers`, a tuple of `(name, kind, param_paths)`, and
`unmatched`, a tuple of `(path, reason substring)`.

Everything is float64 (the tests run with `jax_enable_x64`). Import `ZOO` (a tuple)
or `BY_NAME` (a dict) from here; `ids=` for `pytest.mark.parametrize` is
`[e.name for e in ZOO]`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqfisher as ef


F64 = jnp.float64
BATCH = 5


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    name: str
    model: Callable[[Any], Any]
    batch: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], Any]
    predict: Callable[[Any, Any], Any]
    layers: tuple[tuple[str, str, tuple[str, ...]], ...]
    unmatched: tuple[tuple[str, str], ...] = ()

    def build(self, seed: int = 0) -> tuple[Any, Any]:
        """`(model, batch)` from a fixed seed."""
        mkey, bkey = jr.split(jr.key(seed))
        return self.model(mkey), self.batch(bkey)


def _dense(name, *, bias=True):
    paths = (f".{name}.weight",) + ((f".{name}.bias",) if bias else ())
    return (name, "dense", paths)


def _kind(name, kind, *leaves):
    return (name, kind, tuple(f".{name}.{leaf}" for leaf in leaves))


def _classification(shape, classes):
    def batch(key):
        kx, ky = jr.split(key)
        x = jr.normal(kx, (BATCH, *shape), F64)
        y = jr.randint(ky, (BATCH,), 0, classes)
        return x, y

    return batch


def _vmapped(model, batch):
    return jax.vmap(model)(batch[0])


def _batched(model, batch):
    return model(batch[0])


def _ce_loss(model, batch):
    return ef.softmax_cross_entropy(_vmapped(model, batch), batch[1])


def _mse_loss(model, batch):
    return ef.squared_error(_vmapped(model, batch), batch[1])


def _batched_ce_loss(model, batch):
    return ef.softmax_cross_entropy(_batched(model, batch), batch[1])


def _regression(shape, out):
    def batch(key):
        kx, ky = jr.split(key)
        return jr.normal(kx, (BATCH, *shape), F64), jr.normal(ky, (BATCH, out), F64)

    return batch


# --- 1. eqx.nn.MLP --------------------------------------------------------------


def _mlp(key):
    return eqx.nn.MLP(4, 3, 8, depth=2, activation=jnp.tanh, dtype=F64, key=key)


MLP = ZooEntry(
    "mlp",
    _mlp,
    _classification((4,), 3),
    _ce_loss,
    _vmapped,
    layers=tuple(_dense(f"layers[{i}]") for i in range(3)),
)


# --- 2. CNN: Conv2d + Linear head -----------------------------------------------


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.conv = eqx.nn.Conv2d(2, 3, 3, dtype=F64, key=k1)
        self.head = eqx.nn.Linear(3 * 4 * 4, 4, dtype=F64, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.conv(x)).reshape(-1))


CNN_ENTRY = ZooEntry(
    "cnn",
    CNN,
    _classification((2, 6, 6), 4),
    _ce_loss,
    _vmapped,
    layers=(_kind("conv", "conv", "weight", "bias"), _dense("head")),
)


# --- 3. Transformer block -------------------------------------------------------

VOCAB, SEQ, DIM = 11, 4, 8


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, dtype=F64, key=k1)
        self.attn = eqx.nn.MultiheadAttention(
            2, DIM, use_query_bias=True, use_output_bias=True, dtype=F64, key=k2
        )
        self.norm = eqx.nn.LayerNorm(DIM, dtype=F64)
        self.head = eqx.nn.Linear(DIM, VOCAB, dtype=F64, key=k3)

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        h = h + self.attn(h, h, h)
        h = jax.vmap(self.norm)(h)
        return jax.vmap(self.head)(h)


def _tokens(key):
    kx, ky = jr.split(key)
    return jr.randint(kx, (BATCH, SEQ), 0, VOCAB), jr.randint(
        ky, (BATCH, SEQ), 0, VOCAB
    )


TRANSFORMER = ZooEntry(
    "transformer",
    Transformer,
    _tokens,
    _ce_loss,
    _vmapped,
    layers=(
        _kind("embed", "embedding", "weight"),
        _dense("attn.query_proj"),
        _dense("attn.key_proj", bias=False),
        _dense("attn.value_proj", bias=False),
        _dense("attn.output_proj"),
        _kind("norm", "scale_and_shift", "weight", "bias"),
        _dense("head"),
    ),
)


# --- 4. Hand-written: x @ w + b and einsum --------------------------------------


class HandWritten(eqx.Module):
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array

    def __init__(self, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.w1 = jr.normal(k1, (4, 6), F64) / 2
        self.b1 = jr.normal(k2, (6,), F64)
        self.w2 = jr.normal(k3, (3, 6), F64) / 2
        self.b2 = jr.normal(k4, (3,), F64)

    def __call__(self, x):  # batched: x has shape (batch, 4)
        # Written with implicit rank promotion, as people do (the tests forbid it).
        with jax.numpy_rank_promotion("allow"):
            h = jnp.tanh(x @ self.w1 + self.b1)
            return jnp.einsum("bi,oi->bo", h, self.w2) + self.b2


HANDWRITTEN = ZooEntry(
    "handwritten",
    HandWritten,
    _classification((4,), 3),
    _batched_ce_loss,
    _batched,
    layers=(("w1+b1", "dense", (".w1", ".b1")), ("w2+b2", "dense", (".w2", ".b2"))),
)


# --- 5. filter_jit and jax.checkpoint inside __call__ ---------------------------


class JitCheckpoint(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.first = eqx.nn.Linear(4, 6, dtype=F64, key=k1)
        self.second = eqx.nn.Linear(6, 3, dtype=F64, key=k2)

    def __call__(self, x):
        h = eqx.filter_jit(lambda layer, x: jnp.tanh(layer(x)))(self.first, x)
        return jax.checkpoint(lambda layer, h: layer(h))(self.second, h)


JIT_CHECKPOINT = ZooEntry(
    "jit_checkpoint",
    JitCheckpoint,
    _classification((4,), 3),
    _ce_loss,
    _vmapped,
    layers=(_dense("first"), _dense("second")),
)


# --- 6. An unmatched scalar temperature -----------------------------------------


class Temperature(eqx.Module):
    linear: eqx.nn.Linear
    temperature: jax.Array

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 3, dtype=F64, key=key)
        self.temperature = jnp.array(1.5, F64)

    def __call__(self, x):
        return self.linear(x) * self.temperature


TEMPERATURE = ZooEntry(
    "temperature",
    Temperature,
    _classification((4,), 3),
    _ce_loss,
    _vmapped,
    layers=(_dense("linear"),),
    unmatched=((".temperature", "no layer pattern"),),
)


# --- 7. Conv1d and Conv3d --------------------------------------------------------


class Conv1d3d(eqx.Module):
    conv1: eqx.nn.Conv1d
    conv3: eqx.nn.Conv3d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.conv1 = eqx.nn.Conv1d(2, 3, 3, dtype=F64, key=k1)
        self.conv3 = eqx.nn.Conv3d(2, 2, 2, dtype=F64, key=k2)
        self.head = eqx.nn.Linear(3 * 5 + 2 * 2 * 2 * 2, 3, dtype=F64, key=k3)

    def __call__(self, x):
        seq, vol = x
        a = jnp.tanh(self.conv1(seq)).reshape(-1)
        b = jnp.tanh(self.conv3(vol)).reshape(-1)
        return self.head(jnp.concatenate([a, b]))


def _batch_1d3d(key):
    k1, k2, k3 = jr.split(key, 3)
    seq = jr.normal(k1, (BATCH, 2, 7), F64)
    vol = jr.normal(k2, (BATCH, 2, 3, 3, 3), F64)
    return (seq, vol), jr.randint(k3, (BATCH,), 0, 3)


CONV_1D_3D = ZooEntry(
    "conv1d_conv3d",
    Conv1d3d,
    _batch_1d3d,
    _ce_loss,
    _vmapped,
    layers=(
        _kind("conv1", "conv", "weight", "bias"),
        _kind("conv3", "conv", "weight", "bias"),
        _dense("head"),
    ),
)


# --- 8. NHWC conv written with lax.conv_general_dilated --------------------------


class NHWCConv(eqx.Module):
    kernel: jax.Array  # HWIO
    bias: jax.Array
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.kernel = jr.normal(k1, (3, 3, 2, 4), F64) / 3
        self.bias = jr.normal(k2, (4,), F64)
        self.head = eqx.nn.Linear(4 * 4 * 4, 3, dtype=F64, key=k3)

    def __call__(self, x):  # batched: x has shape (batch, 6, 6, 2)
        y = jax.lax.conv_general_dilated(
            x, self.kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        with jax.numpy_rank_promotion("allow"):
            y = jnp.tanh(y + self.bias)
        return jax.vmap(self.head)(y.reshape(x.shape[0], -1))


NHWC = ZooEntry(
    "nhwc_conv",
    NHWCConv,
    _classification((6, 6, 2), 3),
    _batched_ce_loss,
    _batched,
    layers=(("kernel+bias", "conv", (".kernel", ".bias")), _dense("head")),
)


# --- 9. Conv with stride, padding and dilation -----------------------------------


class StridedConv(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.conv = eqx.nn.Conv2d(
            2,
            3,
            (3, 2),
            stride=(2, 1),
            padding=((1, 2), (0, 1)),
            dilation=(1, 2),
            dtype=F64,
            key=k1,
        )
        self.head = eqx.nn.Linear(3 * 4 * 6, 3, dtype=F64, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.conv(x)).reshape(-1))


STRIDED = ZooEntry(
    "strided_conv",
    StridedConv,
    _classification((2, 7, 7), 3),
    _ce_loss,
    _vmapped,
    layers=(_kind("conv", "conv", "weight", "bias"), _dense("head")),
)


# --- 10. RMSNorm and GroupNorm ---------------------------------------------------


class Norms(eqx.Module):
    linear: eqx.nn.Linear
    rms: eqx.nn.RMSNorm
    conv: eqx.nn.Conv1d
    group: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.linear = eqx.nn.Linear(4, 6, dtype=F64, key=k1)
        self.rms = eqx.nn.RMSNorm(6, dtype=F64)
        self.conv = eqx.nn.Conv1d(1, 4, 3, dtype=F64, key=k2)
        self.group = eqx.nn.GroupNorm(2, 4, dtype=F64)
        self.head = eqx.nn.Linear(4 * 4, 3, dtype=F64, key=k3)

    def __call__(self, x):
        h = self.rms(self.linear(x))
        h = self.group(self.conv(h[None]))
        return self.head(h.reshape(-1))


NORMS = ZooEntry(
    "norms",
    Norms,
    _classification((4,), 3),
    _ce_loss,
    _vmapped,
    layers=(
        _dense("linear"),
        _kind("rms", "scale_and_shift", "weight", "bias"),
        _kind("conv", "conv", "weight", "bias"),
        _kind("group", "scale_and_shift", "weight", "bias"),
        _dense("head"),
    ),
)


# --- 11. Linear without bias -----------------------------------------------------


def _no_bias(key):
    k1, k2 = jr.split(key)
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(4, 5, use_bias=False, dtype=F64, key=k1),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Linear(5, 2, use_bias=False, dtype=F64, key=k2),
        ]
    )


NO_BIAS = ZooEntry(
    "no_bias",
    _no_bias,
    _regression((4,), 2),
    _mse_loss,
    _vmapped,
    layers=(_dense("layers[0]", bias=False), _dense("layers[2]", bias=False)),
)


# --- 12. custom_jvp / custom_vjp wrapping a layer --------------------------------


@jax.custom_jvp
def _jvp_layer(w, b, x):
    return w @ x + b


@_jvp_layer.defjvp
def _jvp_layer_jvp(primals, tangents):
    (w, b, x), (dw, db, dx) = primals, tangents
    return _jvp_layer(w, b, x), dw @ x + w @ dx + db


@jax.custom_vjp
def _vjp_layer(w, b, x):
    return w @ x + b


def _vjp_layer_fwd(w, b, x):
    return w @ x + b, (w, x)


def _vjp_layer_bwd(res, g):
    w, x = res
    return jnp.outer(g, x), g, w.T @ g


_vjp_layer.defvjp(_vjp_layer_fwd, _vjp_layer_bwd)


class CustomDerivatives(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.first = eqx.nn.Linear(4, 6, dtype=F64, key=k1)
        self.second = eqx.nn.Linear(6, 3, dtype=F64, key=k2)

    def __call__(self, x):
        h = jnp.tanh(_jvp_layer(self.first.weight, self.first.bias, x))
        return _vjp_layer(self.second.weight, self.second.bias, h)


CUSTOM_DERIVATIVES = ZooEntry(
    "custom_derivatives",
    CustomDerivatives,
    _classification((4,), 3),
    _ce_loss,
    _vmapped,
    layers=(_dense("first"), _dense("second")),
)


# --- 13. Tied weights ------------------------------------------------------------


class GRUClassifier(eqx.Module):
    """A GRU cell (2 inputs, 3 units) and a linear head (4 classes); applied to one
    `(T, 2)` sequence it scans the cell and classifies the last state. Tests that
    batch time-major sequences use `cell` and `head` directly."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.cell = eqx.nn.GRUCell(2, 3, key=k1)
        self.head = eqx.nn.Linear(3, 4, key=k2)

    def __call__(self, xs):
        h0 = jnp.zeros(3, xs.dtype)
        h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)
        return self.head(h)


class Tied(eqx.Module):
    embed: eqx.nn.Linear
    hidden: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.embed = eqx.nn.Linear(4, 6, dtype=F64, key=k1)
        self.hidden = eqx.nn.Linear(6, 6, dtype=F64, key=k2)

    def __call__(self, x):
        h = jnp.tanh(self.embed(x))
        h = jnp.tanh(self.hidden(h))
        return self.embed.weight.T @ h  # the decoder reuses the encoder's weight


TIED = ZooEntry(
    "tied",
    Tied,
    _regression((4,), 4),
    _mse_loss,
    _vmapped,
    layers=(_dense("hidden"),),
    unmatched=(
        (".embed.weight", "shared"),
        (".embed.bias", "`.embed.weight`, which is unmatched"),
    ),
)


# --- 14. loss_fn under eqx.filter_jit --------------------------------------------


def _jitted_mlp(key):
    return eqx.nn.MLP(3, 2, 5, depth=1, dtype=F64, key=key)


JITTED_LOSS = ZooEntry(
    "jitted_loss",
    _jitted_mlp,
    _regression((3,), 2),
    eqx.filter_jit(_mse_loss),
    _vmapped,
    layers=(_dense("layers[0]"), _dense("layers[1]")),
)


ZOO: tuple[ZooEntry, ...] = (
    MLP,
    CNN_ENTRY,
    TRANSFORMER,
    HANDWRITTEN,
    JIT_CHECKPOINT,
    TEMPERATURE,
    CONV_1D_3D,
    NHWC,
    STRIDED,
    NORMS,
    NO_BIAS,
    CUSTOM_DERIVATIVES,
    TIED,
    JITTED_LOSS,
)
BY_NAME: dict[str, ZooEntry] = {e.name: e for e in ZOO}
