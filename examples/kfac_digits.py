"""K-FAC training with optax on scikit-learn's digits data.

An `eqx.nn.MLP` classifies 8x8 handwritten digits. Each step asks eqfisher for the
loss, the gradient and a K-FAC estimate of the Fisher from one forward pass
(`ef.value_grad_and_curvature`), and hands the curvature to `ef.optim.kfac`, an
optax transformation that averages it, refreshes its cached damped inverse every
few estimates and returns the preconditioned update. `ef.optim.kfac_step` wires
the two together in one jitted training step; here the curvature is estimated at
every second step, the steps in between reuse the cached inverse.

Run it with `python examples/kfac_digits.py` (add `--smoke` for a short run).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqfisher as ef


def load_data(seed: int = 0):
    """Digits as float32 pixels in [0, 1] and int32 labels, split 75/25."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed)
    return (jnp.asarray(x_tr), jnp.asarray(y_tr)), (
        jnp.asarray(x_te),
        jnp.asarray(y_te),
    )


def loss_fn(model, batch):
    # Ordinary JAX: the only eqfisher call registers the loss, which tells the tracer
    # where the model's outputs are and which distribution (categorical) they define.
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def accuracy(model, batch) -> float:
    x, y = batch
    return float(jnp.mean(jnp.argmax(jax.vmap(model)(x), -1).astype(y.dtype) == y))


def main(smoke: bool = False) -> dict:
    steps = 60 if smoke else 300
    width = 64 if smoke else 128
    batch_size = 256
    train, test = load_data()
    key = jax.random.key(0)
    # float32 explicitly: the model must not follow `jax_enable_x64` when it is on.
    model = eqx.nn.MLP(
        64, 10, width, 2, activation=jax.nn.relu, dtype=jnp.float32, key=key
    )

    # The tracer finds the three `Linear` layers of the MLP (under `jax.vmap`).
    print(ef.find_layers(loss_fn, model, (train[0][:2], train[1][:2])))

    # The Monte-Carlo Fisher (one sampled label per example) is what K-FAC usually
    # uses; `ef.GGN()` or `ef.FisherExact()` work the same way.
    estimator, structure = ef.FisherMC(), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    # K-FAC as optax, at its defaults except the learning rate. `like` is the shape of
    # the curvature the updates will see (no computation): the optimiser state holds
    # the averaged curvature and its cached inverse from `init` on, so the jitted step
    # compiles once.
    sample = (train[0][:batch_size], train[1][:batch_size])
    like = ef.optim.curvature_like(vgc, model, sample, key=key)
    opt = ef.optim.kfac(0.1, like=like)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = ef.optim.kfac_step(
        loss_fn,
        opt,
        estimator=estimator,
        structure=structure,
        curvature_update_period=2,
    )

    rng = np.random.default_rng(0)
    n = train[0].shape[0]
    evaluate = eqx.filter_jit(loss_fn)
    history = []
    for i in range(steps):
        idx = rng.choice(n, batch_size, replace=False)
        model, state, loss = step(
            model, state, (train[0][idx], train[1][idx]), jax.random.fold_in(key, i)
        )
        if (i + 1) % 20 == 0:
            history.append(float(evaluate(model, train)))
            print(f"step {i + 1:4d}  training loss {history[-1]:.4f}")

    result = {
        "train_loss": float(evaluate(model, train)),
        "train_accuracy": accuracy(model, train),
        "test_accuracy": accuracy(model, test),
        # The non-finite guard: how many curvature estimates were rejected.
        "curvature_ok": bool(ef.optim.curvature_ok(state)),
        "history": history,
    }
    print(
        f"final: training loss {result['train_loss']:.4f}, "
        f"train accuracy {result['train_accuracy']:.3f}, "
        f"test accuracy {result['test_accuracy']:.3f}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(smoke=parser.parse_args().smoke)
