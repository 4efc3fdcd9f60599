"""Statistics of layers stacked with `eqx.filter_vmap` and applied by `lax.scan`.

**Per-example taps.**
With `KFAC(weight_sharing="reduce")` a layer's factors need only each example's
sum of output cotangents and mean input row, so the statistics perturb its output
by a per-example array (size 1 along the other location axes: its cotangent is the
sum) and a kept scan stores the mean input rows, not every location of every step
(`_statistics.per_example_taps`). Checked here against the factors' definitions
(Eschenhagen et al. 2023) computed without eqfisher, on transformer blocks stacked
with `eqx.filter_vmap` and applied with `lax.scan`, whose LayerNorms read and
perturb the same activations in full; and in bfloat16, whose cotangent sums stay
per location.

**Stacked blocks.** A stacked layer's per-step blocks are built at once (`vmap`
over the steps' statistics, for structures with `steps_alike`) and stored as one
block with a leading step axis (`Curvature.stored`), given back one step at a time
by `Curvature.blocks`. Checked: the same blocks as a structure built step by step,
the moving average, shapes-only curvatures, and one output array per stacked
factor from a jitted function.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqfisher as ef
from eqfisher.blocks import kronecker
from eqfisher.internal import StagedLoss, per_example_taps, split

from .helpers import dense_ggn_cross_entropy, perturbed


F64 = jnp.float64
N, T, D0, D, C, STEPS = 3, 4, 2, 4, 3, 2
PROJECTIONS = ("q", "k", "v", "o", "up", "down")


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jr.split(key, 8)
        self.norm1 = eqx.nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(D, D, key=k) for k in keys[:4])
        self.norm2 = eqx.nn.LayerNorm(D)
        self.up = eqx.nn.Linear(D, 2 * D, key=keys[4])
        self.down = eqx.nn.Linear(2 * D, D, key=keys[5])


def _block(block, x, perturb=None):
    """One block on `(T, D)`; `perturb` adds to each projection's output."""

    def proj(name, h):
        y = jax.vmap(getattr(block, name))(h)
        return y if perturb is None else y + perturb[name]

    h = jax.vmap(block.norm1)(x)
    q, k, v = proj("q", h), proj("k", h), proj("v", h)
    weights = jax.nn.softmax(q @ k.T / jnp.sqrt(D), axis=-1)
    x = x + proj("o", weights @ v)
    h = jax.vmap(block.norm2)(x)
    return x + proj("down", jnp.tanh(proj("up", h)))


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: Block  # stacked: every leaf has a leading axis of size STEPS
    head: eqx.nn.Linear

    def __init__(self, key, dtype=F64, steps=STEPS):
        k1, k2, k3 = jr.split(key, 3)
        self.embed = eqx.nn.Linear(D0, D, key=k1, dtype=dtype)
        blocks = eqx.filter_vmap(Block)(jr.split(k2, steps))
        self.blocks = jax.tree_util.tree_map(
            lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, blocks
        )
        self.head = eqx.nn.Linear(D, C, key=k3, dtype=dtype)

    def __call__(self, x):  # (T, D0) -> (C,)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, b):
            return _block(eqx.combine(b, static), h), None

        h, _ = jax.lax.scan(step, jax.vmap(self.embed)(x), dynamic)
        return self.head(h.mean(0))


def _problem(dtype=F64):
    model = perturbed(Net(jr.key(0), dtype), jr.key(1))
    x = jr.normal(jr.key(2), (N, T, D0), dtype)
    y = jr.randint(jr.key(3), (N,), 0, C)
    return model, (x, y)


def loss_fn(model, batch):
    x, y = batch
    return ef.softmax_cross_entropy(jax.vmap(model)(x), y)


def _kfac_reduce(model, batch):
    return ef.curvature(
        loss_fn,
        model,
        batch,
        estimator=ef.GGN(),
        structure=ef.KFAC(weight_sharing="reduce"),
    )


def _reference_factors(model, x, y):
    """Each step's projections' "reduce" factors, by their definitions: A the mean
    over examples of ā ā^T (ā = [mean input row; 1]), G = Σ_k Σ_n ĝ_kn ĝ_kn^T with
    ĝ_kn the example's sum over its locations of the output cotangents of the GGN's
    vectors V_k (Σ_k V_k V_k^T = the loss Hessian)."""
    _, static = eqx.partition(model.blocks, eqx.is_array)

    def net(perturb):
        inputs = {}
        h = jax.vmap(jax.vmap(model.embed))(x)
        for s in range(STEPS):
            block = jax.tree_util.tree_map(
                lambda a, s=s: a[s] if eqx.is_array(a) else a, model.blocks
            )
            block = eqx.combine(eqx.filter(block, eqx.is_array), static)
            seen = {}

            def record(name, pre, block=block, seen=seen):
                seen[name] = pre
                return jax.vmap(jax.vmap(getattr(block, name)))(pre)

            hn = jax.vmap(jax.vmap(block.norm1))(h)
            q, k, v = (record(n, hn) + perturb[s][n] for n in ("q", "k", "v"))
            w = jax.nn.softmax(jnp.einsum("ntd,nsd->nts", q, k) / jnp.sqrt(D), axis=-1)
            h = h + record("o", jnp.einsum("nts,nsd->ntd", w, v)) + perturb[s]["o"]
            hn = jax.vmap(jax.vmap(block.norm2))(h)
            u = jnp.tanh(record("up", hn) + perturb[s]["up"])
            h = h + record("down", u) + perturb[s]["down"]
            inputs[s] = seen
        return jax.vmap(model.head)(h.mean(1)), inputs

    sizes = {"q": D, "k": D, "v": D, "o": D, "up": 2 * D, "down": D}
    zeros = [{n: jnp.zeros((N, T, sizes[n]), F64) for n in PROJECTIONS}] * STEPS
    logits, vjp, inputs = jax.vjp(net, zeros, has_aux=True)
    p = jax.nn.softmax(logits)
    s = jnp.einsum("ij,nj->nij", jnp.eye(C), jnp.sqrt(p)) - jnp.einsum(
        "ni,nj->nij", p, jnp.sqrt(p)
    )
    vectors = jnp.moveaxis(s, -1, 0) / jnp.sqrt(float(N))  # (k, n, C)
    (g,) = jax.vmap(vjp)(vectors)
    factors = {}
    for step in range(STEPS):
        for name in PROJECTIONS:
            a = inputs[step][name].mean(1)  # (n, d_in): each example's mean row
            a = jnp.concatenate([a, jnp.ones((N, 1), F64)], axis=1)
            g_hat = g[step][name].sum(2)  # (k, n, d_out)
            factors[f"blocks.{name}[{step}]"] = (
                a.T @ a / N,
                jnp.einsum("kni,knj->ij", g_hat, g_hat),
            )
    return factors


def test_reduce_factors_of_scanned_blocks_match_their_definitions():
    model, (x, y) = _problem()
    curv = _kfac_reduce(model, (x, y))
    reference = _reference_factors(model, x, y)
    for name, (a, g) in reference.items():
        np.testing.assert_allclose(curv.blocks[name].a, a, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(curv.blocks[name].g, g, atol=1e-12, err_msg=name)


def test_layernorm_diagonals_beside_reduce_taps_are_exact():
    """The LayerNorms' outputs are the projections' inputs (read as means for
    them): their own exact diagonals still see every location."""
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    ggn = dense_ggn_cross_entropy(model, *batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    offsets = np.cumsum([0] + [x.size for x in jax.tree_util.tree_leaves(params)])
    diagonal = np.diag(ggn)
    checked = 0
    for i, path in enumerate(paths):
        if ".norm" not in path:
            continue
        leaf = diagonal[offsets[i] : offsets[i + 1]].reshape(STEPS, D)
        for step in range(STEPS):
            name = f"blocks{path[len('.blocks') : path.rindex('.')]}[{step}]"
            field = path[path.rindex(".") + 1 :]
            block = curv.blocks[name]
            got = block.diag[0 if field == "weight" else 1]
            np.testing.assert_allclose(got, leaf[step], atol=1e-12, err_msg=name)
            checked += 1
    assert checked == 4 * STEPS


def _taps(model, batch):
    staged = StagedLoss(loss_fn, "test")
    processed = staged.stage(split(model, batch))
    records = processed.layers
    # As `curvature` asks with KFAC("reduce"): the LayerNorms' diagonals need
    # every location.
    dense = [r for r in records if r.kind.name == "dense"]
    return dense, per_example_taps(records, dense)


def test_taps_are_per_example_in_float64():
    """The projections' perturbations have one location per example and their
    inputs are averaged over the sequence axis inside the scan."""
    model, batch = _problem()
    records, (shapes, means) = _taps(model, batch)
    stacked = [r for r in records if r.name.startswith("blocks.")]
    assert len(stacked) == len(PROJECTIONS) * STEPS
    for r in stacked:
        point = r.outputs.stacked
        assert shapes[id(point)] == (STEPS, N, 1, point.aval.shape[-1]), r.name
        assert means[id(r.inputs.stacked)] == (1,), r.name


@pytest.mark.parametrize("sharing", ["reduce", "expand"])
def test_bfloat16_reduce_keeps_per_location_cotangents(sharing):
    """bfloat16 outputs keep their per-location cotangents (summed in float32
    afterwards); the factors match float32's to bfloat16 precision."""
    model, (x, y) = _problem(jnp.bfloat16)
    _, (shapes, means) = _taps(model, (x, y))
    assert not shapes and means
    model32 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, model
    )
    kwargs = dict(estimator=ef.GGN(), structure=ef.KFAC(weight_sharing=sharing))
    low = ef.curvature(loss_fn, model, (x, y), **kwargs)
    high = ef.curvature(loss_fn, model32, (x.astype(jnp.float32), y), **kwargs)
    for name in ("blocks.up[1]", "blocks.q[0]"):
        for f in ("a", "g"):
            got, want = getattr(low.blocks[name], f), getattr(high.blocks[name], f)
            assert got.dtype == jnp.float32
            scale = float(jnp.max(jnp.abs(want)))
            np.testing.assert_allclose(got, want, atol=0.05 * scale, err_msg=name)


class StepByStepKFAC(ef.AbstractKroneckerStructure):
    """K-FAC whose blocks are built one step at a time (`steps_alike = False`)."""

    weight_sharing: str = "reduce"
    steps_alike = False

    def kronecker_needs(self):
        return ef.Needs(kronecker=True, weight_sharing=self.weight_sharing)

    def kronecker_block(self, group, statistics):
        return statistics.kronecker()


@pytest.mark.parametrize(
    "structure, by_step",
    [
        (ef.KFAC(weight_sharing="reduce"), StepByStepKFAC()),
        (ef.EKFAC(), None),
        (ef.Diagonal(), None),
    ],
)
def test_stacked_blocks_equal_blocks_built_step_by_step(structure, by_step):
    model, batch = _problem()
    curv = ef.curvature(loss_fn, model, batch, estimator=ef.GGN(), structure=structure)
    assert type(structure).steps_alike and not StepByStepKFAC.steps_alike
    # One stored block per stacked layer, its arrays with a leading step axis.
    assert len(curv.runs) == len(PROJECTIONS) + 2
    for run in curv.runs:
        assert run == tuple(f"{run[0][:-3]}[{k}]" for k in range(STEPS))
        for x in jax.tree_util.tree_leaves(curv.stored[run[0]]):
            assert x.shape[0] == STEPS
    assert list(curv.blocks) == [name for name, _ in curv.leaf_indices]
    reference = ef.curvature(
        loss_fn, model, batch, estimator=ef.GGN(), structure=by_step or ef.Dense()
    )
    if by_step is not None:
        for name, block in curv.blocks.items():
            want = reference.blocks[name]
            assert type(block) is type(want), name
            for x, y in zip(
                jax.tree_util.tree_leaves(block), jax.tree_util.tree_leaves(want)
            ):
                np.testing.assert_allclose(x, y, atol=1e-13, err_msg=name)
    else:
        # Every block against the dense GGN's own block of its parameters.
        dense = reference.as_matrix()
        full = curv.as_matrix()
        mask = np.asarray(full != 0)
        if isinstance(structure, ef.EKFAC):
            # EKFAC's blocks are exact in their bases only: compare the diagonal of
            # each block in the dense GGN with its trace.
            assert np.allclose(np.trace(full), np.trace(dense), atol=1e-10)
        else:
            np.testing.assert_allclose(full[mask], np.asarray(dense)[mask], atol=1e-12)


def test_stacked_moving_average_and_shapes():
    model, batch = _problem()
    kwargs = dict(estimator=ef.GGN(), structure=ef.KFAC(weight_sharing="reduce"))
    curv = ef.curvature(loss_fn, model, batch, **kwargs)
    other = ef.curvature(loss_fn, model, (batch[0] + 1.0, batch[1]), **kwargs)
    average = curv.ema(other, 0.25)
    assert average.runs == curv.runs
    for name, block in average.blocks.items():
        want = curv.blocks[name].ema(other.blocks[name], 0.25)
        for x, y in zip(
            jax.tree_util.tree_leaves(block), jax.tree_util.tree_leaves(want)
        ):
            np.testing.assert_allclose(x, y, atol=1e-14, err_msg=name)
    like = eqx.filter_eval_shape(
        lambda m: ef.curvature(loss_fn, m, batch, **kwargs), model
    )
    for name, block in like.blocks.items():
        got = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(block)]
        want = [
            (x.shape, x.dtype) for x in jax.tree_util.tree_leaves(curv.blocks[name])
        ]
        assert got == want, name


def test_jitted_curvature_outputs_one_array_per_stacked_factor():
    model, batch = _problem()
    fn = eqx.filter_jit(
        ef.value_grad_and_curvature(
            loss_fn, estimator=ef.GGN(), structure=ef.KFAC(weight_sharing="reduce")
        )
    )
    _, _, curv = fn(model, batch)
    per_step = sum(len(jax.tree_util.tree_leaves(b)) for b in curv.blocks.values())
    stored = len(jax.tree_util.tree_leaves(curv))
    # 6 projections and 2 LayerNorms, 2 arrays each, over 2 steps; and the
    # embedding's and head's factors.
    assert per_step == 2 * 8 * STEPS + 4
    assert stored == 2 * 8 + 4


@pytest.mark.parametrize("structure", [ef.KFAC(), ef.KFAC(weight_sharing="reduce")])
def test_compiled_statistics_of_stacked_blocks_do_not_grow_with_the_steps(structure):
    # The steps' blocks are built at once from stacked statistics: the compiled
    # program has as many kernels for 16 stacked blocks as for 4. (jaxlib 0.12's
    # XLA:CPU compiled a slice per step of the LayerNorms' per-example rows,
    # stacked again for the blocks, from 12 steps on: 2 kernels a step.)
    x = jr.normal(jr.key(2), (N, T, D0))
    y = jr.randint(jr.key(3), (N,), 0, C)
    fn = ef.value_grad_and_curvature(
        loss_fn, estimator=ef.FisherMC(), structure=structure
    )

    def kernels(steps):
        params, static = eqx.partition(Net(jr.key(0), F64, steps), eqx.is_array)

        def arrays(params, batch, key):
            out = fn(eqx.combine(params, static), batch, key=key)
            return eqx.filter(out, eqx.is_array)

        compiled = jax.jit(arrays).lower(params, (x, y), jr.key(4)).compile()
        return compiled.as_text().count(" fusion(")

    assert kernels(16) == kernels(4)


@pytest.mark.parametrize("damping", [ef.optim.FactoredTikhonov(), ef.optim.Tikhonov()])
def test_map_blocks_inverts_a_stacked_layer_at_once(damping):
    """The optimiser's damped inverses (`Curvature.map_blocks`) of the stacked
    blocks equal those of each step's block."""
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    inverse = curv.map_blocks(lambda b: damping.precompute(b, 0.1))
    assert inverse.runs == curv.runs
    for name, block in curv.blocks.items():
        want = damping.precompute(block, 0.1)
        got = inverse.blocks[name]
        assert type(got) is type(want), name
        np.testing.assert_allclose(got.as_matrix(), want.as_matrix(), atol=1e-10)


def test_map_blocks_names_are_checked():
    # `names=` a later step of a stacked layer, an unknown name or a bare string
    # changed nothing, silently.
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    run = next(r for r in curv.runs if len(r) > 1)
    doubled = curv.map_blocks(lambda b: b.scale(2.0), names=[run[0]])
    for step in run:
        np.testing.assert_allclose(
            doubled.blocks[step].as_matrix(), 2 * curv.blocks[step].as_matrix()
        )
    with pytest.raises(
        ValueError, match=rf"stored \(with its other steps\) as `{re.escape(run[0])}`"
    ):
        curv.map_blocks(lambda b: b.scale(2.0), names=[run[1]])
    with pytest.raises(ValueError, match="no block `nowhere`; the stored blocks"):
        curv.map_blocks(lambda b: b.scale(2.0), names=["nowhere"])
    with pytest.raises(TypeError, match="a sequence of block names"):
        curv.map_blocks(lambda b: b.scale(2.0), names=run[0])
    with pytest.raises(TypeError, match="`fn` must return a block"):
        curv.map_blocks(lambda b: b.as_matrix())


def test_tree_at_replaces_a_stacked_block_and_names_the_views():
    """A stacked layer's `blocks` are views: `eqx.tree_at` through one failed with
    "'_LeafWrapper' object is not subscriptable"; it now names `stored`, which
    works."""
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    run = next(r for r in curv.runs if len(r) > 1)
    with pytest.raises(TypeError, match=r"c\.stored\[run\[0\]\]"):
        eqx.tree_at(lambda c: c.blocks[run[1]], curv, curv.blocks[run[1]])
    doubled = eqx.tree_at(
        lambda c: c.stored[run[0]], curv, curv.stored[run[0]].scale(2.0)
    )
    for step in run:
        np.testing.assert_allclose(
            doubled.blocks[step].as_matrix(), 2 * curv.blocks[step].as_matrix()
        )


def test_tree_at_reaches_an_unstacked_block_beside_a_stacked_layer():
    """`eqx.tree_at` through `blocks` of a block that is no step (the head) failed
    when the model also had a stacked layer ("cannot reach them"); it works, and
    the stacked layer's steps are unchanged."""
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    run = next(r for r in curv.runs if len(r) > 1)
    steps = {name for r in curv.runs for name in r}
    head = next(name for name in curv.blocks if name not in steps)
    doubled = eqx.tree_at(lambda c: c.blocks[head], curv, curv.blocks[head].scale(2.0))
    np.testing.assert_allclose(
        doubled.blocks[head].as_matrix(), 2 * curv.blocks[head].as_matrix()
    )
    np.testing.assert_array_equal(
        doubled.blocks[run[1]].as_matrix(), curv.blocks[run[1]].as_matrix()
    )


def test_a_stacked_block_replaced_by_one_step_is_refused():
    """`eqx.tree_at` could put one step's block where the stacked block is stored:
    `mv` then mapped over the factors' rows. Refused, naming the leading axis."""
    model, batch = _problem()
    curv = _kfac_reduce(model, batch)
    run = next(r for r in curv.runs if len(r) > 1)
    one = eqx.tree_at(lambda c: c.stored[run[0]], curv, curv.blocks[run[0]])
    grads = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    for method in (lambda c: c.mv(grads), lambda c: c.blocks, lambda c: c.trace()):
        with pytest.raises(ValueError, match=rf"leading axis of {len(run)}"):
            method(one)


@pytest.mark.parametrize("eigh_max_dim", [0, 64], ids=["cholesky", "eigh"])
def test_batched_pi_damped_inverse_falls_back_per_step(eigh_max_dim, monkeypatch):
    """A stack of factors inverts by Cholesky (or, small factors, by their clamped
    eigendecomposition); a step whose Cholesky fails (an indefinite factor, as
    float32 rounding can leave) takes the clamped eigendecomposition, the others
    keep theirs: as inverted one by one. The inverse stays differentiable in the
    damping."""
    monkeypatch.setattr(kronecker, "EIGH_MAX_DIM", eigh_max_dim)
    k = jr.normal(jr.key(0), (3, 4, 4), F64)
    a = k @ jnp.swapaxes(k, 1, 2)
    a = a.at[1].set(-jnp.eye(4, dtype=F64))
    g = jnp.broadcast_to(jnp.eye(2, dtype=F64), (3, 2, 2))
    weight = jax.ShapeDtypeStruct((2, 4), F64)

    def inverse(a, g, lam):
        block = ef.blocks.KroneckerFactored(
            a, g, weight_perm=(0, 1), structure=(weight,)
        )
        return block.pi_damped_inverse(lam)

    stacked = jax.jit(jax.vmap(inverse, in_axes=(0, 0, None)))(a, g, 0.1)
    for step in range(3):
        one = inverse(a[step], g[step], 0.1)
        np.testing.assert_allclose(stacked.a[step], one.a, atol=1e-12)
        np.testing.assert_allclose(stacked.g[step], one.g, atol=1e-12)
    assert np.all(np.isfinite(stacked.a))

    def total(lam):
        return jnp.sum(inverse(a[0], g[0], lam).a)

    eps = 1e-6
    numeric = (total(0.1 + eps) - total(0.1 - eps)) / (2 * eps)
    np.testing.assert_allclose(jax.grad(total)(0.1), numeric, rtol=1e-6)


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "xla"])
def test_shifted_inverses_by_size_class_equal_the_clamped_inverses(on_host):
    """`kronecker.shifted_inverses` inverts stacks of matrix factors: on the host
    (the CPU's default; in float64 by `potrs` below `POTRI_MIN_DIM`, 128, and by
    `potri` for the 300 and the 400), or in XLA by size class, each padded with an identity block to its class's size (100
    and a stack of two 70s by Cholesky, 9 and 5 by eigendecomposition; 300 and 400
    above `PAD_MAX_DIM` alone). An indefinite one is inverted by the clamped
    eigendecomposition (a 70: Cholesky's fallback), a diagonal one elementwise:
    each is (clamp(F) + shift·I)⁻¹."""
    sizes = [5, 9, 3, 300, 4, 70, 100, 400]
    factors = []
    for i, d in enumerate(sizes):
        k = jr.normal(jr.key(i), (2, d, d + 2), F64)
        factors.append(k @ jnp.swapaxes(k, 1, 2) / d)
    factors[0] = factors[0] - 2 * jnp.eye(5, dtype=F64)[None]  # indefinite
    factors[5] = factors[5].at[1].add(-2 * jnp.eye(70, dtype=F64))  # Cholesky fails
    factors[4] = jnp.diagonal(factors[4], axis1=1, axis2=2)  # diagonal factors
    factors = [f if i in (5, 6) else f[:1] for i, f in enumerate(factors)]
    shifts = [jnp.full(f.shape[:1], 0.1 * (i + 1), F64) for i, f in enumerate(factors)]
    got = jax.jit(lambda f, s: kronecker.shifted_inverses(f, s, on_host))(
        factors, shifts
    )
    for stack, shift, inverses in zip(factors, shifts, got):
        assert inverses.shape == stack.shape and inverses.dtype == stack.dtype
        for f, s, inv in zip(stack, shift, inverses):
            if f.ndim == 1:
                want = 1 / (np.maximum(f, 0) + float(s))
                np.testing.assert_allclose(inv, want, rtol=1e-12)
                continue
            values, vectors = np.linalg.eigh(np.asarray(f))
            want = (vectors / (np.maximum(values, 0) + float(s))) @ vectors.T
            np.testing.assert_allclose(inv, want, rtol=1e-9, atol=1e-10)
