"""Several stop-gradient views of one model in one forward pass.

A model has three parts: an `encoder`, a `dynamics` map iterated for many steps in a
`jax.lax.scan` (the expensive part), and a `readout`. Three losses each train one
part, and some of them *use* parts they must not train:

- `dynamics` loss: keeps the rollout's states at unit norm; trains `dynamics` only;
- `readout` loss: fits targets from the rollout's final state; trains `readout`;
- `encoder` loss: the encoder is a one-shot shortcut for the rollout. Its output,
  passed through the readout, must match the readout of the rollout. It goes through
  `readout`, yet trains `encoder` only.

`ef.filters.stop_gradient(model, where)` returns a *view* of the model whose
selected parameters get zero cotangents; values are unchanged, so every view can be
used in one function and the scan runs once. The alternative, one gradient call per
loss with the other parts frozen, runs the scan three times. This script checks that
both give the same gradients, counts the scans in each program, and trains the model
with the single-pass function.

Run it with `python examples/stop_gradient_views.py` (add `--smoke` for a short run).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfisher as ef


class Model(eqx.Module):
    encoder: eqx.nn.Linear
    dynamics: eqx.nn.Linear
    readout: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.Linear(8, 16, dtype=jnp.float32, key=k1)
        self.dynamics = eqx.nn.Linear(16, 16, dtype=jnp.float32, key=k2)
        self.readout = eqx.nn.Linear(16, 4, dtype=jnp.float32, key=k3)


STEPS = 50


def rollout(dynamics: eqx.nn.Linear, h0):
    """The expensive part: `STEPS` applications of the dynamics, states stacked."""

    def step(h, _):
        h = jnp.tanh(jax.vmap(dynamics)(h))
        return h, h

    return jax.lax.scan(step, h0, None, length=STEPS)[1]  # (STEPS, batch, 16)


def unit_norm_loss(states):
    return jnp.mean((jnp.sum(states**2, axis=-1) - 1.0) ** 2)


def squared_distance(a, b):
    return jnp.mean(jnp.sum((a - b) ** 2, axis=-1))


def losses_with_views(model: Model, batch):
    """All three losses from one forward pass; each trains its own part."""
    x, y = batch
    by_path, stop = ef.filters.by_path, ef.filters.stop_gradient
    # A view per loss: every parameter but the loss's own part is stopped.
    enc = stop(model, ~by_path("encoder*"))
    dyn = stop(model, ~by_path("dynamics*"))
    out = stop(model, ~by_path("readout*"))

    h0 = jax.vmap(enc.encoder)(x)
    # The rollout starts from the encoding but must not train the encoder: that is a
    # stop on an activation, not on parameters.
    states = rollout(dyn.dynamics, jax.lax.stop_gradient(h0))
    final = jax.lax.stop_gradient(states[-1])
    dynamics_loss = unit_norm_loss(states)
    readout_loss = squared_distance(jax.vmap(out.readout)(final), y)
    # The same readout weights again, now frozen: this loss trains the encoder only.
    target = jax.lax.stop_gradient(jax.vmap(model.readout)(final))
    encoder_loss = squared_distance(jax.vmap(enc.readout)(h0), target)
    return dynamics_loss + readout_loss + encoder_loss


def gradients_one_by_one(model: Model, batch):
    """The same gradients the usual way: one `grad` per part, the rest frozen."""
    x, y = batch
    grads = jax.tree_util.tree_map(jnp.zeros_like, model)

    def part_grad(name, loss_of_part):
        part = getattr(model, name)
        return eqx.tree_at(
            lambda m: getattr(m, name), grads, jax.grad(loss_of_part)(part)
        )

    h0 = jax.vmap(model.encoder)(x)

    def dynamics_loss(dynamics):
        return unit_norm_loss(rollout(dynamics, h0))

    def readout_loss(readout):
        final = rollout(model.dynamics, h0)[-1]
        return squared_distance(jax.vmap(readout)(final), y)

    def encoder_loss(encoder):
        final = rollout(model.dynamics, h0)[-1]
        target = jax.vmap(model.readout)(final)
        return squared_distance(jax.vmap(model.readout)(jax.vmap(encoder)(x)), target)

    parts = [
        part_grad("dynamics", dynamics_loss),
        part_grad("readout", readout_loss),
        part_grad("encoder", encoder_loss),
    ]
    return jax.tree_util.tree_map(lambda *g: sum(g), *parts)


def count(jaxpr, name: str) -> int:
    """Occurrences of primitive `name`, inside nested jaxprs too."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                n += count(sub, name) if hasattr(sub, "eqns") else 0
    return n


def main(smoke: bool = False) -> dict:
    steps = 100 if smoke else 1000
    key = jax.random.key(0)
    model = Model(key)
    x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    y = jnp.tanh(x[:, :4] - x[:, 4:])
    batch = (x, y)

    grads = jax.grad(losses_with_views)(model, batch)
    reference = gradients_one_by_one(model, batch)
    error = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)
        )
    )
    scans_views = count(jax.make_jaxpr(losses_with_views)(model, batch).jaxpr, "scan")
    scans_separate = count(
        jax.make_jaxpr(gradients_one_by_one)(model, batch).jaxpr, "scan"
    )
    print(f"largest gradient difference, views vs one grad per part: {error:.2e}")
    print(f"scans in the forward pass with views: {scans_views}")
    print(
        f"scans in the one-grad-per-part program (forward and backward): {scans_separate}"
    )

    # Train all three parts with the one-pass function.
    opt = optax.adam(3e-3)
    state = opt.init(model)

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(losses_with_views)(model, batch)
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    history = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        history.append(float(loss))
    print(
        f"total loss: {history[0]:.4f} at the start, {history[-1]:.4f} after {steps} steps"
    )
    return {
        "gradient_error": error,
        "gradient_scale": float(
            max(np.max(np.abs(g)) for g in jax.tree_util.tree_leaves(reference))
        ),
        "scans_with_views": scans_views,
        "scans_one_by_one": scans_separate,
        "initial_loss": history[0],
        "final_loss": history[-1],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(smoke=parser.parse_args().smoke)
