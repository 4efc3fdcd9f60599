"""`kfac_step` with `has_aux=`, `where=` and `examples=`: each equals the
training loop written by hand from `value_grad_and_curvature` with the same
option (float64, three steps at period 2, so with and without statistics)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfisher as ef
from eqfisher import optim

from .helpers import tree_allclose
from .optim_problem import loss_fn, problem


def _step(loss, opt, **options):
    """`kfac_step` with the GGN in K-FAC form, as every test here uses."""
    return optim.kfac_step(
        loss, opt, estimator=ef.GGN(), structure=ef.KFAC(), **options
    )


def _vgc(**kwargs):
    return ef.value_grad_and_curvature(
        loss_fn, estimator=ef.GGN(), structure=ef.KFAC(), **kwargs
    )


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def _by_hand(vgc, opt, model, batch, steps, period=2, key=None):
    """The loop of docs/optim.md: statistics at steps 0, period, ...; the values
    `vgc` returned, and the final model."""
    state, values = opt.init(_params(model)), []
    for i in range(steps):
        kwargs = {} if key is None else {"key": jax.random.fold_in(key, i)}
        value, grads, curv = vgc(model, batch, **kwargs)
        extra = {"curvature": curv} if i % period == 0 else {}
        updates, state = opt.update(grads, state, _params(model), **extra)
        model = eqx.apply_updates(model, updates)
        values.append(value)
    return model, values


def _run(step, opt, model, batch, steps, key=None):
    state, values = opt.init(_params(model)), []
    for i in range(steps):
        k = None if key is None else jax.random.fold_in(key, i)
        model, state, value = step(model, state, batch, k)
        values.append(value)
    return model, state, values


def _loss_and_accuracy(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    return ef.softmax_cross_entropy(logits, y), {"accuracy": accuracy, "n": y.shape[0]}


@pytest.mark.parametrize("curvature_batch_size", [None, 16])
def test_has_aux_returns_the_aux_and_steps_as_without(curvature_batch_size):
    model, batch = problem()
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, batch))
    sub = {"curvature_batch_size": curvature_batch_size}
    step = _step(_loss_and_accuracy, opt, has_aux=True, **sub)
    plain = _step(loss_fn, opt, **sub)
    got, _, values = _run(step, opt, model, batch, 3)
    want, _, losses = _run(plain, opt, model, batch, 3)
    assert tree_allclose(_params(got), _params(want), rtol=1e-12, atol=1e-14)
    for (loss, aux), expected in zip(values, losses):
        np.testing.assert_allclose(loss, expected, rtol=1e-12)
        assert set(aux) == {"accuracy", "n"} and int(aux["n"]) == 64
    # The first step's aux is that of the model passed in.
    x, y = batch
    accuracy = jnp.mean(jnp.argmax(jax.vmap(model)(x), -1) == y)
    np.testing.assert_allclose(values[0][1]["accuracy"], accuracy)


def test_has_aux_aux_follows_the_model_of_each_step():
    model, batch = problem()
    vgc = ef.value_grad_and_curvature(
        _loss_and_accuracy, estimator=ef.GGN(), structure=ef.KFAC(), has_aux=True
    )
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    step = _step(_loss_and_accuracy, opt, has_aux=True)
    got, _, values = _run(step, opt, model, batch, 3)
    want, expected = _by_hand(vgc, opt, model, batch, 3)
    assert tree_allclose(_params(got), _params(want), rtol=1e-10, atol=1e-12)
    for (loss, aux), (e_loss, e_aux) in zip(values, expected):
        np.testing.assert_allclose(loss, e_loss, rtol=1e-12)
        np.testing.assert_allclose(aux["accuracy"], e_aux["accuracy"])


def test_a_tuple_loss_without_has_aux_names_kfac_step():
    model, batch = problem()
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, batch))
    step = _step(_loss_and_accuracy, opt)
    with pytest.raises((TypeError, ValueError), match=r"kfac_step.*has_aux=True"):
        step(model, opt.init(_params(model)), batch)


def _policy_gradient_loss(model, batch):
    """A natural policy gradient's `(loss, surrogate)`: the registered loss of the
    actions taken (whose curvature is the policy's Fisher) and the
    advantage-weighted log-likelihood, advantages of either sign."""
    x, actions = batch
    logits = jax.vmap(model)(x)
    advantages = jnp.where(actions == 0, 1.0, -0.5) * jnp.linspace(0.2, 1.0, len(x))
    log_p = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], -1)
    return ef.softmax_cross_entropy(logits, actions), -jnp.mean(
        advantages * log_p[:, 0]
    )


@pytest.mark.parametrize("curvature_batch_size", [None, 16])
def test_surrogate_steps_along_the_surrogates_preconditioned_gradient(
    curvature_batch_size,
):
    """`surrogate=True`: each step is the hand-written loop's with
    `value_grad_and_curvature(surrogate=True)` (the statistics from the first 16
    examples where asked), and the value is the registered loss."""
    model, batch = problem()
    vgc = ef.value_grad_and_curvature(
        _policy_gradient_loss, estimator=ef.GGN(), structure=ef.KFAC(), surrogate=True
    )
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    step = _step(
        _policy_gradient_loss,
        opt,
        surrogate=True,
        curvature_batch_size=curvature_batch_size,
    )
    got, _, values = _run(step, opt, model, batch, 3)
    if curvature_batch_size is None:
        by_hand = vgc
    else:

        def by_hand(model, batch):
            sub = jax.tree_util.tree_map(lambda a: a[:curvature_batch_size], batch)
            _, _, curv = vgc(model, sub)
            value, grads, _ = vgc(model, batch)
            return value, grads, curv

    want, losses = _by_hand(by_hand, opt, model, batch, 3)
    assert tree_allclose(_params(got), _params(want), rtol=1e-10, atol=1e-12)
    for value, loss in zip(values, losses):
        np.testing.assert_allclose(value, loss, rtol=1e-10)
    # Not the step the registered loss's own gradient gives.
    plain, _, _ = _run(_step(loss_fn, opt), opt, model, batch, 3)
    assert not tree_allclose(_params(got), _params(plain), rtol=1e-3, atol=1e-3)


def test_a_tuple_loss_without_surrogate_names_it(unchecked):
    del unchecked
    model, batch = problem()
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, batch))
    step = _step(_policy_gradient_loss, opt)
    with pytest.raises(TypeError, match=r"kfac_step.*surrogate=True"):
        step(model, opt.init(_params(model)), batch)
    with pytest.raises(ValueError, match="at most one of `has_aux` and `surrogate`"):
        _step(_policy_gradient_loss, opt, has_aux=True, surrogate=True)


def test_has_aux_must_be_a_bool(unchecked):
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), *problem()))
    with pytest.raises(TypeError, match=r"kfac_step\(has_aux=...\)"):
        _step(loss_fn, opt, has_aux=1)


def _middle_layer_kfac(model, batch):
    """`(where, vgc, mask, rest, kfac)` for K-FAC on `layers[1]` alone: the
    curvature function over it, its optax mask and the mask's negation."""
    where = ef.filters.by_path("layers[1].*")
    vgc = _vgc(where=where)
    mask = ef.filters.optax_mask(model, where)
    rest = jax.tree_util.tree_map(lambda m: not m, mask)
    kfac = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    return where, vgc, mask, rest, kfac


def _moved(got, model):
    """For each parameter leaf, whether training changed it."""
    return jax.tree_util.tree_map(
        lambda a, b: bool(jnp.any(a != b)), _params(got), _params(model)
    )


def test_where_preconditions_the_selected_layer_and_adam_the_rest():
    # docs/optim.md's partial K-FAC: the curvature of `layers[1]` only; K-FAC on
    # those parameters, Adam on the others, composed with two `optax.masked`.
    model, batch = problem()
    where, vgc, mask, rest, kfac = _middle_layer_kfac(model, batch)
    opt = optax.chain(optax.masked(kfac, mask), optax.masked(optax.adam(1e-2), rest))
    step = _step(loss_fn, opt, where=where)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes dtypes
        got, state, _ = _run(step, opt, model, batch, 3)
        want, _ = _by_hand(vgc, opt, model, batch, 3)
    assert tree_allclose(_params(got), _params(want), rtol=1e-10, atol=1e-12)
    kstate = optim.find_kfac_state(state)
    assert int(kstate.curvature_count) == 2 and list(kstate.curvature.blocks) == [
        "layers[1]"
    ]
    # Every parameter moved: layers[1] by K-FAC, the others by Adam.
    assert all(jax.tree_util.tree_leaves(_moved(got, model)))


def test_masked_kfac_alone_is_refused_and_set_to_zero_freezes():
    # `optax.masked(kfac, mask)` alone passes the other leaves' gradients through
    # as their updates: a step up the gradient (the loss climbed 1.1 -> 37 in ten
    # steps). Refused, naming the leaves and the fix; the fix freezes them.
    model, batch = problem()
    where, _, mask, rest, kfac = _middle_layer_kfac(model, batch)
    alone = optax.masked(kfac, mask)
    step = _step(loss_fn, alone, where=where)
    with pytest.raises(
        ValueError, match=r"kfac_step.*layers\[0\]\.weight.*set_to_zero"
    ):
        step(model, alone.init(_params(model)), batch)
    frozen = optax.chain(alone, optax.masked(optax.set_to_zero(), rest))
    got, _, _ = _run(_step(loss_fn, frozen, where=where), frozen, model, batch, 2)
    assert _moved(got, model) == jax.tree_util.tree_map(bool, mask)


class _Normed(eqx.Module):
    """A dense layer, a LayerNorm (scale-and-shift rows, whose exact diagonal
    blocks K-FAC takes from per-example vectors) and a head."""

    hidden: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(3, 6, key=k1)
        self.norm = eqx.nn.LayerNorm(6)
        self.head = eqx.nn.Linear(6, 2, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.norm(self.hidden(x))))


def _time_major_loss(model, batch):
    xt, y = batch  # xt: (3, N), features first
    return ef.softmax_cross_entropy(jax.vmap(model, in_axes=1)(xt), y)


def test_examples_time_major_batch():
    model = _Normed(jax.random.key(7))
    _, (x, y) = problem()
    batch = (x.T, y)
    examples = ef.IndependentExamples(axis=(1, 0))
    vgc = ef.value_grad_and_curvature(
        _time_major_loss, estimator=ef.GGN(), structure=ef.KFAC(), examples=examples
    )
    opt = optim.kfac(0.1, like=optim.curvature_like(vgc, model, batch))
    step = _step(_time_major_loss, opt, examples=examples)
    got, state, _ = _run(step, opt, model, batch, 3)
    want, _ = _by_hand(vgc, opt, model, batch, 3)
    assert tree_allclose(_params(got), _params(want), rtol=1e-10, atol=1e-12)
    # Without `examples=` the LayerNorm's per-example rows are refused, and the
    # error names the step and the option it takes.
    leading = _step(_time_major_loss, opt)
    with pytest.raises(ValueError, match=r"kfac_step.*examples=eqfisher"):
        _run(leading, opt, model, batch, 1)
    assert "norm" in optim.find_kfac_state(state).curvature.blocks


def test_curvature_batch_size_refuses_examples_off_the_leading_axis():
    model, batch = problem()
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, batch))
    with pytest.raises(ValueError, match=r"curvature_batch_size.*leading axis"):
        _step(
            loss_fn,
            opt,
            curvature_batch_size=8,
            examples=ef.IndependentExamples(axis=1),
        )


def test_a_state_of_another_optimiser_is_named():
    # docs/optim.md once rebound `opt` to a grafted chain and passed the earlier
    # `kfac`'s state to a step built on it: optax's error was a PyTree mismatch
    # inside Adam's moments.
    model, batch = problem()
    like = optim.curvature_like(_vgc(), model, batch)
    grafted = optax.chain(
        optim.graft(
            optim.kfac_preconditioner(like=like, norm_constraint=None),
            optax.scale_by_adam(),
        ),
        optax.scale_by_learning_rate(1e-2),
    )
    state = optim.kfac(1e-2, like=like).init(_params(model))
    step = _step(loss_fn, grafted)
    with pytest.raises(ValueError, match=r"`opt_state` is not a state of the"):
        step(model, state, batch)


def test_a_failed_check_in_the_step_is_equinox_error(capfd):
    # The step's own jit let a failed `eqx.error_if` out as jax's
    # `JaxRuntimeError` from a host callback, the message inside a traceback and
    # Equinox's advice to use `eqx.filter_jit`; jax also logged it to stderr.
    model, (x, y) = problem()
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, (x, y)))
    step = _step(loss_fn, opt)
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        step(model, opt.init(_params(model)), (x, y.at[0].set(7)))
    message = str(info.value)
    assert message.startswith("`eqfisher.softmax_cross_entropy(logits, labels)`")
    assert "filter_jit" not in message and "Traceback" not in message
    assert "pure_callback failed" not in capfd.readouterr().err


def test_aux_keeps_leaves_that_are_not_arrays():
    # As `eqx.filter_value_and_grad`: other leaves are static, returned as they
    # are (a string crashed the trace; Python numbers came back as jax's).
    model, batch = problem()

    def tagged(model, batch):
        loss, aux = _loss_and_accuracy(model, batch)
        return loss, {**aux, "tag": "digits", "lr": 0.1, "flag": True}

    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), model, batch))
    step = _step(tagged, opt, has_aux=True)
    _, _, (_, aux) = step(model, opt.init(_params(model)), batch)
    assert aux["tag"] == "digits" and aux["n"] == 64 and aux["flag"] is True
    assert type(aux["n"]) is int and type(aux["lr"]) is float
    assert isinstance(aux["accuracy"], jax.Array)
    vgc = ef.value_grad_and_curvature(
        tagged, estimator=ef.GGN(), structure=ef.KFAC(), has_aux=True
    )
    (_, aux), _, _ = vgc(model, batch)
    assert aux["tag"] == "digits" and type(aux["n"]) is int


@pytest.mark.parametrize(
    "name,value",
    [
        ("decay", 1.5),
        ("inverse_every", 0),
        ("momentum", float("nan")),
        ("momentum", 1.0),
        ("weight_decay", -1.0),
        ("learning_rate", -1.0),
        ("damping", 0.0),
    ],
)
def test_hyperparameters_set_in_the_state_are_checked(name, value):
    # Under `optax.inject_hyperparams` they are arrays in the state, out of reach
    # of the checks made when the optimiser is built; a decay of 1.5 was used, and
    # a NaN momentum made a NaN model (it acts after the finite guard).
    model, batch = problem()
    like = optim.curvature_like(_vgc(), model, batch)
    opt = optax.inject_hyperparams(optim.kfac)(
        learning_rate=0.1, like=like, momentum=0.5, weight_decay=1e-4
    )
    step = _step(loss_fn, opt)
    state = opt.init(_params(model))
    step(model, state, batch)  # in range: runs
    state.hyperparams[name] = jnp.asarray(value, state.hyperparams[name].dtype)
    with pytest.raises(eqx.EquinoxRuntimeError, match=rf"`{name}` must be") as info:
        step(model, state, batch)
    # The learning rate's and damping's said "a schedule returned" it: none did.
    assert "inject_hyperparams`'s state" in str(info.value)


@pytest.mark.parametrize(
    "name,value", [("curvature_update_period", 0), ("curvature_batch_size", -1)]
)
def test_bad_periods_and_sizes_name_the_step_once(name, value):
    opt = optim.kfac(0.1, like=optim.curvature_like(_vgc(), *problem()))
    with pytest.raises(ValueError) as info:
        _step(loss_fn, opt, **{name: value})
    assert str(info.value).startswith(f"`eqfisher.optim.kfac_step(..., {name}=...)`")


@pytest.mark.parametrize("has_aux", [False, True])
def test_adaptive_kfac_steps_as_the_hand_written_step(has_aux):
    """`kfac_step` gives `kfac_adaptive`'s update the batch's quadratic model: the
    steps of docs/optim.md's hand-written loop, the damping adapted alike."""
    model, batch = problem()
    opt = optim.kfac_adaptive(
        like=optim.curvature_like(_vgc(), model, batch), adapt_every=2
    )
    loss = _loss_and_accuracy if has_aux else loss_fn
    step = _step(loss, opt, has_aux=has_aux, curvature_update_period=1)
    got, state, _ = _run(step, opt, model, batch, 4)
    vgc, want, expected = _vgc(), model, opt.init(_params(model))
    for _ in range(4):
        _, grads, curv = vgc(want, batch)
        quadratic = optim.quadratic_model(loss_fn, want, batch)
        updates, expected = opt.update(
            grads, expected, _params(want), curvature=curv, quadratic=quadratic
        )
        want = eqx.apply_updates(want, updates)
    assert tree_allclose(_params(got), _params(want), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.steps.damping, expected.steps.damping)
    assert float(state.steps.damping) != 1.0  # adapted from `initial_damping`


def test_adaptive_kfac_on_a_subset_steps_as_on_the_subset_alone():
    """`kfac_adaptive` on a `where=` subset, beside `set_to_zero` on the rest
    (the `optax.masked` composition of docs/optim.md): its quadratic model was of
    the whole model, and its Gram matrix of the subset's leaves crashed in
    Equinox's closure conversion. It steps as `kfac_adaptive` on a model holding
    only the subset (the rest closed over), the damping adapted alike."""
    model, batch = problem()
    where = ef.filters.by_path("layers[1].*")
    mask = ef.filters.optax_mask(model, where)
    rest = jax.tree.map(lambda m: not m, mask)
    like = optim.curvature_like(_vgc(where=where), model, batch)
    adaptive = optim.kfac_adaptive(like=like, adapt_every=2)
    opt = optax.chain(
        optax.masked(adaptive, mask), optax.masked(optax.set_to_zero(), rest)
    )
    step = _step(loss_fn, opt, where=where, curvature_update_period=1)
    got, _, _ = _run(step, opt, model, batch, 4)

    frozen = model.layers[0]

    def sub_loss(head, batch):
        return loss_fn(eqx.tree_at(lambda m: m.layers[1], model, head), batch)

    sub_opt = optim.kfac_adaptive(
        like=optim.curvature_like(
            ef.value_grad_and_curvature(
                sub_loss, estimator=ef.GGN(), structure=ef.KFAC()
            ),
            model.layers[1],
            batch,
        ),
        adapt_every=2,
    )
    want, state, _ = _run(
        _step(sub_loss, sub_opt, curvature_update_period=1),
        sub_opt,
        model.layers[1],
        batch,
        4,
    )
    assert tree_allclose(_params(got.layers[1]), _params(want), rtol=1e-10, atol=1e-12)
    assert tree_allclose(_params(got.layers[0]), _params(frozen), rtol=0, atol=0)
    assert float(state.steps.damping) != 1.0  # adapted from `initial_damping`


def test_adaptive_kfac_with_a_surrogate_is_refused():
    model, batch = problem()
    opt = optim.kfac_adaptive(like=optim.curvature_like(_vgc(), model, batch))
    step = _step(_policy_gradient_loss, opt, surrogate=True)
    with pytest.raises(ValueError, match="surrogate=True.*kfac_adaptive"):
        step(model, opt.init(_params(model)), batch)


@jax.tree_util.register_pytree_node_class
class _Weights:
    """Parameters in a class registered with `jax.tree_util`, without `__eq__`."""

    def __init__(self, w1, w2):
        self.w1, self.w2 = w1, w2

    def tree_flatten(self):
        return (self.w1, self.w2), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)


def test_parameters_in_a_registered_class_without_eq_train():
    # The curvature's static operand structure held the class's instances, which
    # compare by identity: two curvatures of one model had other tree structures,
    # and `kfac_step` refused its own curvature at the first step.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    model = _Weights(jax.random.normal(k1, (3, 4)), jax.random.normal(k2, (4, 2)))
    batch = (jax.random.normal(k3, (8, 3)), jnp.zeros((8, 2)))

    def weights_loss(m, b):
        return ef.squared_error(jnp.tanh(b[0] @ m.w1) @ m.w2, b[1])

    kw = dict(estimator=ef.GGN(), structure=ef.KFAC())
    vgc = ef.value_grad_and_curvature(weights_loss, **kw)
    like = optim.curvature_like(vgc, model, batch)
    assert jax.tree_util.tree_structure(like) == jax.tree_util.tree_structure(
        vgc(model, batch)[2]
    )
    opt = optim.kfac(0.1, like=like)
    state = opt.init(model)
    step = optim.kfac_step(weights_loss, opt, **kw)
    losses = []
    for _ in range(3):
        model, state, loss = step(model, state, batch)
        losses.append(float(loss))
    assert losses[2] < losses[0]
