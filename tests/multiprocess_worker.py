"""One process of the two-process run in `test_multiprocess.py`.

`python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz` joins a
`jax.distributed` cluster on localhost (CPU collectives: gloo, JAX's default since
0.5.1), with two CPU devices per process. Every process builds the same model and
the same global batch, keeps only its own slice of the batch, assembles the global
arrays with `jax.make_array_from_process_local_data` and runs `compute`. The test
runs the same `compute` on one device in its own process and compares.

Importing this module has no side effect: the test imports `compute` and `problem`.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import eqfisher as ef


LOCAL_DEVICES = 2
N_EXAMPLES = 16
STEPS = 3


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def problem():
    """`(model, (x, y))` in float64, the same in every process."""
    model = eqx.nn.MLP(5, 3, 6, 2, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model
    )
    x = jax.random.normal(jax.random.key(1), (N_EXAMPLES, 5), jnp.float64)
    y = jax.random.randint(jax.random.key(2), (N_EXAMPLES,), 0, 3)
    return model, (x, y)


def _flat(tree) -> np.ndarray:
    """Every array of `tree`, gathered to this host and ravelled into one vector."""
    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    if jax.process_count() > 1:
        # Results may be sharded over processes; gather them (a collective: every
        # process calls this in the same order).
        leaves = [multihost_utils.process_allgather(a, tiled=True) for a in leaves]
    return ravel_pytree([np.asarray(a) for a in leaves])[0]


def compute(model, batch) -> dict[str, np.ndarray]:
    """Curvature matrices, `value_grad_and_curvature` and K-FAC optimiser steps."""
    cases = {
        "kfac_ggn": (ef.GGN(), ef.KFAC()),
        "dense_ggn": (ef.GGN(), ef.Dense()),
        "blockdiag_fisher": (ef.FisherExact(), ef.BlockDiagonal()),
    }

    @eqx.filter_jit
    def matrices(m, b):
        return {
            name: ef.curvature(
                loss_fn, m, b, estimator=estimator, structure=structure
            ).as_matrix()
            for name, (estimator, structure) in cases.items()
        }

    out = {name: _flat(a) for name, a in matrices(model, batch).items()}

    estimator, structure = ef.FisherMC(samples=2), ef.KFAC()
    vgc = ef.value_grad_and_curvature(loss_fn, estimator=estimator, structure=structure)
    key = jax.random.key(3)

    @eqx.filter_jit
    def statistics(m, b, key):
        loss, grads, curv = vgc(m, b, key=key)
        return loss, grads, curv.as_matrix()

    loss, grads, matrix = statistics(model, batch, key)
    out["vgc_loss"] = _flat(loss)
    out["vgc_grads"] = _flat(grads)
    out["vgc_curvature"] = _flat(matrix)

    like = ef.optim.curvature_like(vgc, model, batch, key=key)
    opt = ef.optim.kfac(0.1, like=like, inverse_every=2)
    # Compiled, its state replicated as the parameters are (docs/scale.md).
    params = eqx.filter(model, eqx.is_inexact_array)
    replicated = jax.tree_util.tree_leaves(params)[0].sharding
    state = jax.jit(opt.init, out_shardings=replicated)(params)
    step = ef.optim.kfac_step(loss_fn, opt, estimator=estimator, structure=structure)
    losses = []
    for i in range(STEPS):
        model, state, loss = step(model, state, batch, jax.random.key(10 + i))
        losses.append(_flat(loss))
    out["kfac_losses"] = np.concatenate(losses)
    out["kfac_params"] = _flat(model)
    out["kfac_state"] = _flat(ef.optim.find_kfac_state(state).curvature)
    return out


def _global(sharding, local):
    return jax.tree_util.tree_map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)),
        local,
    )


def main(process_id: int, num_processes: int, port: int, path: str) -> None:
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    assert len(devices) == LOCAL_DEVICES * num_processes, devices
    assert len(jax.local_devices()) == LOCAL_DEVICES
    mesh = Mesh(np.array(devices), ("data",))
    examples = NamedSharding(mesh, P("data"))  # the leading axis over all devices
    replicated = NamedSharding(mesh, P())

    model, (x, y) = problem()
    per_process = N_EXAMPLES // num_processes
    mine = slice(process_id * per_process, (process_id + 1) * per_process)
    batch = _global(examples, (x[mine], y[mine]))
    params, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(_global(replicated, params), static)

    gx = batch[0]
    assert gx.shape == x.shape and not gx.is_fully_addressable
    assert len(gx.sharding.device_set) == LOCAL_DEVICES * num_processes
    assert {s.data.shape for s in gx.addressable_shards} == {
        (N_EXAMPLES // len(devices), x.shape[1])
    }

    out = compute(model, batch)
    out["process_count"] = np.asarray(jax.process_count())
    out["global_devices"] = np.asarray(len(devices))
    np.savez(path, **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
