"""Edge of stability: the sharpness of full-batch gradient descent rises to 2/lr.

Cohen et al. (2021) observed that with full-batch gradient descent at step size lr
the largest Hessian eigenvalue (the sharpness) first grows ("progressive
sharpening") until it reaches 2/lr, the value beyond which gradient descent on a
quadratic diverges, and then hovers there while the loss keeps falling,
non-monotonically. This script trains a tanh MLP with the squared error on the
digits data and tracks, every few steps, the top eigenvalue of the Hessian
(`ef.hessian_operator`) and of the GGN (`ef.ggn_operator`) with
`ef.spectral.top_eigenpairs` (Lanczos, a few tens of products each), against 2/lr.
It writes `edge_of_stability.png`.

Run it with `python examples/edge_of_stability.py` (add `--smoke` for a short run).
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from sklearn.datasets import load_digits

import eqfisher as ef


def data(n: int):
    x, y = load_digits(return_X_y=True)
    x = (x[:n] / 16.0).astype(np.float32)
    return jnp.asarray(x), jax.nn.one_hot(jnp.asarray(y[:n]), 10, dtype=jnp.float32)


def loss_fn(model, batch):
    x, y = batch
    return ef.squared_error(jax.vmap(model)(x), y)


@eqx.filter_jit
def sharpness(model, batch, key):
    """The top eigenvalues of the Hessian and of the GGN, by Lanczos."""
    k1, k2 = jax.random.split(key)
    hessian = ef.hessian_operator(loss_fn, model, batch)
    ggn = ef.ggn_operator(loss_fn, model, batch)
    top_h, _ = ef.spectral.top_eigenpairs(hessian, 1, key=k1, iterations=20)
    top_g, _ = ef.spectral.top_eigenpairs(ggn, 1, key=k2, iterations=20)
    return top_h[0], top_g[0]


@eqx.filter_jit
def step(model, batch, lr):
    loss, grad = eqx.filter_value_and_grad(loss_fn)(model, batch)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grad))
    return model, loss


def dense_top_hessian(model, batch) -> float:
    """The top Hessian eigenvalue from `jax.hessian` of the ravelled parameters."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    h = jax.hessian(lambda f: loss_fn(eqx.combine(unravel(f), static), batch))(flat)
    return float(np.linalg.eigvalsh(np.asarray(h, np.float64))[-1])


def plot(path, steps, losses, evals, tops, threshold):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.semilogy(np.arange(steps), losses)
    ax1.set(xlabel="step", ylabel="training loss", title="full-batch GD")
    ax2.plot(evals, tops[:, 0], label="Hessian λ_max")
    ax2.plot(evals, tops[:, 1], label="GGN λ_max", linestyle="--")
    ax2.axhline(threshold, color="k", linestyle=":", label="2 / lr")
    ax2.set(xlabel="step", ylabel="top eigenvalue", title="sharpness")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(smoke: bool = False, out: str = "edge_of_stability.png") -> dict:
    n, width = (256, 16) if smoke else (1000, 64)
    steps, every = (60, 20) if smoke else (3000, 50)
    lr = 0.1
    batch = data(n)
    model = eqx.nn.MLP(
        64, 10, width, 2, activation=jnp.tanh, dtype=jnp.float32, key=jax.random.key(0)
    )
    lr_ = jnp.asarray(lr, jnp.float32)
    losses, evals, tops = [], [], []
    key = jax.random.key(1)
    for t in range(steps):
        if t % every == 0 or t == steps - 1:
            tops.append(
                [float(v) for v in sharpness(model, batch, jax.random.fold_in(key, t))]
            )
            evals.append(t)
            print(
                f"step {t:5d}  loss {float(loss_fn(model, batch)):.4f}  "
                f"Hessian λ_max {tops[-1][0]:8.3f}  GGN λ_max {tops[-1][1]:8.3f}  "
                f"2/lr {2 / lr:.3f}"
            )
        model, loss = step(model, batch, lr_)
        losses.append(float(loss))
    tops = np.asarray(tops)
    plot(out, steps, losses, evals, tops, 2 / lr)
    result = {
        "losses": losses,
        "eval_steps": evals,
        "hessian_top": tops[:, 0],
        "ggn_top": tops[:, 1],
        "threshold": 2 / lr,
        "png": out,
    }
    # After the sharpness first reaches 2/lr it stays near it.
    reached = np.flatnonzero(tops[:, 0] >= 2 / lr)
    if reached.size:
        late = tops[reached[0] :, 0]
        result["first_reached"] = evals[reached[0]]
        result["after_mean"] = float(np.mean(late))
        print(
            f"λ_max first reached 2/lr = {2 / lr:g} at step {evals[reached[0]]}; "
            f"mean after: {np.mean(late):.3f}, range [{late.min():.3f}, "
            f"{late.max():.3f}]"
        )
    if smoke:  # small enough for a dense Hessian
        result["lanczos_top"] = float(sharpness(model, batch, key)[0])
        result["dense_top"] = dense_top_hessian(model, batch)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    parser.add_argument("--out", default="edge_of_stability.png", help="the PNG")
    args = parser.parse_args()
    main(smoke=args.smoke, out=str(pathlib.Path(args.out)))
