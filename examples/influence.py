r"""Influence of training points on a test prediction, by CG on the exact GGN.

Koh & Liang's influence function asks how the loss on a test point would change if a
training point were up-weighted:

$$
\mathcal I(z_\text{train}, z_\text{test})
= -\nabla L(z_\text{test})^\top (G + \lambda I)^{-1} \nabla L(z_\text{train}),
$$

with $G$ the curvature of the training loss at the trained weights. Here $G$ is the
exact generalised Gauss-Newton matrix, positive semidefinite where the Hessian need
not be, applied matrix-free by `ef.ggn_operator`, and $\lambda > 0$ a damping.
`ef.influence.influence_scores` with `ef.influence.ConjugateGradient` solves once
for the test gradient (`lineax.CG`) and pairs the solution with every training
gradient, a chunk of examples at a time. Its score is
$\nabla L(z_\text{test})^\top (G + \lambda I)^{-1} \nabla L(z_\text{train})$, so
$\mathcal I = -\text{score}$.

A positive influence means up-weighting the training point would *raise* the test
loss (harmful); a negative one, that it would lower it (helpful).

The model is small, so the script also builds $G$ densely (`as_matrix()`) and checks
the scores against a dense solve.

Run it with `python examples/influence.py` (add `--smoke` for a short run).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqfisher as ef


def load_data(n_train: int, seed: int = 0):
    """Digits as float32 pixels in [0, 1] and int32 labels; `n_train` training points."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed)
    train = (jnp.asarray(x_tr[:n_train]), jnp.asarray(y_tr[:n_train]))
    return train, (jnp.asarray(x_te), jnp.asarray(y_te))


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def train(model, batch, steps: int):
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(loss_fn)(model, batch)
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state

    for _ in range(steps):
        model, state = step(model, state)
    return model


@eqx.filter_jit
def per_example_gradients(model, batch):
    """∇L(zₙ) for every example, stacked on a leading axis (a PyTree)."""
    x, y = batch
    single = lambda xi, yi: eqx.filter_grad(loss_fn)(model, (xi[None], yi[None]))
    return jax.vmap(single)(x, y)


def main(smoke: bool = False) -> dict:
    n_train = 300 if smoke else 1000
    width = 16 if smoke else 32
    damping = 1e-2
    train_set, test_set = load_data(n_train)
    model = eqx.nn.MLP(
        64, 10, width, 1, activation=jnp.tanh, dtype=jnp.float32, key=jax.random.key(0)
    )
    model = train(model, train_set, 300)

    # The test point: the first misclassified test digit (or the first one).
    logits = jax.vmap(model)(test_set[0])
    wrong = np.flatnonzero(np.argmax(logits, -1) != np.asarray(test_set[1]))
    t = int(wrong[0]) if len(wrong) else 0
    z_test = (test_set[0][t : t + 1], test_set[1][t : t + 1])
    g_test = eqx.filter_grad(loss_fn)(model, z_test)

    # The exact GGN of the mean training loss, matrix-free, inverted by CG.
    ggn = ef.ggn_operator(loss_fn, model, train_set)
    inverse = ef.influence.ConjugateGradient(ggn, damping, rtol=1e-5, atol=1e-5)
    scores = eqx.filter_jit(ef.influence.influence_scores)(
        loss_fn, model, train_set, z_test, inverse, chunk_size=100
    )
    influence = -scores[0]

    # The dense check: rows of `as_matrix()` follow `ravel_pytree` of the parameters.
    g_matrix = ggn.as_matrix()
    dense = jnp.linalg.solve(
        g_matrix + damping * jnp.eye(g_matrix.shape[0], dtype=g_matrix.dtype),
        ravel_pytree(g_test)[0],
    )
    per_example = per_example_gradients(model, train_set)
    flat = jax.vmap(lambda g: ravel_pytree(g)[0])(per_example)  # (n_train, P)
    influence_dense = -(flat @ dense)
    solve_error = float(
        jnp.linalg.norm(influence - influence_dense) / jnp.linalg.norm(influence_dense)
    )
    print(
        f"parameters: {g_matrix.shape[0]}; CG vs dense solve, relative error of the "
        f"influences {solve_error:.2e}"
    )

    order = np.argsort(np.asarray(influence))
    labels = np.asarray(train_set[1])
    print(
        f"\ntest digit #{t}: label {int(test_set[1][t])}, "
        f"predicted {int(jnp.argmax(logits[t]))}"
    )
    for title, idx in (("most helpful", order[:5]), ("most harmful", order[::-1][:5])):
        print(f"{title} training points (index: label, influence):")
        print(
            "  "
            + ", ".join(f"{i}: {labels[i]}, {float(influence[i]):+.3g}" for i in idx)
        )
    return {
        "test_index": t,
        "solve_error": solve_error,
        "influence": np.asarray(influence),
        "influence_dense": np.asarray(influence_dense),
        "helpful": order[:5].tolist(),
        "harmful": order[::-1][:5].tolist(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(smoke=parser.parse_args().smoke)
