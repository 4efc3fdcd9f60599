r"""Continual learning with elastic weight consolidation (EWC) on split digits.

Task A is to tell the digits 0–4 apart, task B the digits 5–9. One MLP with two
output heads (logits 0–4 for task A, 5–9 for task B; the "multi-head" split-digits
protocol) learns A, then B. Training on B moves the shared hidden layers and the
network forgets A. EWC (Kirkpatrick et al., 2017) adds to task B's loss the penalty

$$
\frac{\lambda}{2} \sum_i F_i \, (\theta_i - \theta^*_i)^2,
$$

with $\theta^*$ the weights after task A and $F$ the diagonal of task A's Fisher,
which eqfisher computes exactly with `structure=ef.Diagonal()`: parameters that
mattered for A are held in place, the others stay free for B.

Run it with `python examples/ewc_split_digits.py` (add `--smoke` for a short run).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import eqfisher as ef


def load_tasks(seed: int = 0):
    """(train, test) for task A (digits 0–4) and task B (5–9); labels 0–4 per task."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed)
    tasks = {}
    for name, low in (("A", 0), ("B", 5)):
        tr = (y_tr >= low) & (y_tr < low + 5)
        te = (y_te >= low) & (y_te < low + 5)
        tasks[name] = (
            (jnp.asarray(x_tr[tr]), jnp.asarray(y_tr[tr] - low)),
            (jnp.asarray(x_te[te]), jnp.asarray(y_te[te] - low)),
        )
    return tasks


def head(name: str) -> slice:
    return slice(0, 5) if name == "A" else slice(5, 10)


def task_loss(name: str):
    def loss_fn(model, batch):
        x, y = batch
        # The loss is registered on this task's head only: its Fisher is task A's.
        return ef.softmax_cross_entropy(jax.vmap(model)(x)[:, head(name)], y)

    return loss_fn


def accuracy(model, batch, name: str) -> float:
    x, y = batch
    logits = jax.vmap(model)(x)[:, head(name)]
    return float(jnp.mean(jnp.argmax(logits, -1).astype(y.dtype) == y))


def train(model, batch, loss_fn, steps: int, penalty=None):
    """Full-batch Adam on `loss_fn`, plus `penalty(params)` when given."""
    opt = optax.adam(1e-3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = opt.init(params)

    def objective(p):
        value = loss_fn(eqx.combine(p, static), batch)
        return value if penalty is None else value + penalty(p)

    @jax.jit
    def step(p, state):
        grads = jax.grad(objective)(p)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(p, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return eqx.combine(params, static)


def main(smoke: bool = False) -> dict:
    steps = 300 if smoke else 1000
    strength = 1e3  # λ; the Fisher below is that of the *mean* loss over task A
    tasks = load_tasks()
    (train_a, test_a), (train_b, test_b) = tasks["A"], tasks["B"]
    model = eqx.nn.MLP(
        64, 10, 64, 2, activation=jax.nn.relu, dtype=jnp.float32, key=jax.random.key(0)
    )

    model_a = train(model, train_a, task_loss("A"), steps)
    acc_a = accuracy(model_a, test_a, "A")
    print(f"after task A: task A test accuracy {acc_a:.3f}")

    # The exact diagonal of task A's Fisher, a PyTree shaped like the parameters.
    # `FisherExact()` is the Fisher under the model's own predictive distribution;
    # `EmpiricalFisher()` (squared gradients at the data labels) is a common cheaper
    # stand-in in EWC implementations.
    fisher = eqx.filter_jit(ef.curvature)(
        task_loss("A"),
        model_a,
        train_a,
        estimator=ef.FisherExact(),
        structure=ef.Diagonal(),
    ).diagonal()
    anchor = eqx.filter(model_a, eqx.is_inexact_array)

    def ewc_penalty(params):
        terms = jax.tree_util.tree_map(
            lambda f, p, a: jnp.sum(f * jnp.square(p - a)), fisher, params, anchor
        )
        return 0.5 * strength * sum(jax.tree_util.tree_leaves(terms))

    results = {"task_A_before": acc_a}
    for label, penalty in (("fine-tuning", None), ("EWC", ewc_penalty)):
        model_b = train(model_a, train_b, task_loss("B"), steps, penalty)
        results[label] = {
            "task_A": accuracy(model_b, test_a, "A"),
            "task_B": accuracy(model_b, test_b, "B"),
        }

    header = f"{'after task B':<14}{'task A acc':>12}{'task B acc':>12}"
    print("\n" + header + "\n" + "-" * len(header))
    for label in ("fine-tuning", "EWC"):
        r = results[label]
        print(f"{label:<14}{r['task_A']:>12.3f}{r['task_B']:>12.3f}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(smoke=parser.parse_args().smoke)
