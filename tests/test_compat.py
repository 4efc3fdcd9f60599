"""What eqfisher's tracer assumes of JAX's internals (`eqfisher/_compat.py`), one
test per assumption, so that a JAX release that moves one fails a test naming it.

Every primitive parameter the tracer reads (`_compat.PARAMS_READ`) is pinned here:
present on this JAX, and of the form the tracer reads (each equation from a small
function whose parameters are known). Then the scan's operand groups, the bodies of
call-like equations (`jit`, `checkpoint`, custom derivatives), literals and dropped
outputs."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqfisher import _compat


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _compat.sub_jaxprs(value):
                yield from _eqns(sub)


def _eqn(fn, *args, primitive: str):
    """The first equation of `primitive` in `fn(*args)`'s jaxpr (nested bodies too)."""
    found = [
        e
        for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        if e.primitive.name == primitive
    ]
    assert found, f"`{primitive}` is not in the jaxpr of {fn}"
    return found[0]


x3 = jnp.zeros((2, 3, 4))
x2 = jnp.zeros((3, 4))
image = jnp.zeros((2, 3, 8, 8))  # NCHW
kernel = jnp.zeros((5, 3, 3, 3))  # OIHW


def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (2, 1), ((1, 1), (0, 0)), lhs_dilation=(1, 1), rhs_dilation=(1, 2)
    )


def _window(op):
    init, fn = {
        "sum": (0.0, jax.lax.add),
        "max": (-jnp.inf, jax.lax.max),
        "min": (jnp.inf, jax.lax.min),
    }[op]
    return lambda x: jax.lax.reduce_window(x, init, fn, (1, 2), (1, 2), "VALID")


def _reduce(name):
    fns = {
        "reduce_sum": lambda x: jnp.sum(x, axis=(0, 2)),
        "reduce_max": lambda x: jnp.max(x, axis=(0, 2)),
        "reduce_min": lambda x: jnp.min(x, axis=(0, 2)),
        "reduce_prod": lambda x: jnp.prod(x, axis=(0, 2)),
        "reduce_and": lambda x: jnp.all(x > 0, axis=(0, 2)),
        "reduce_or": lambda x: jnp.any(x > 0, axis=(0, 2)),
    }
    return fns[name]


def _check_axes(value, eqn):
    assert tuple(value) == (0, 2)


# (primitive, parameter) -> (function, its arguments, what the tracer assumes)
PINS = {
    ("transpose", "permutation"): (
        lambda x: jnp.transpose(x, (2, 0, 1)),
        (x3,),
        lambda v, e: tuple(v) == (2, 0, 1),
    ),
    ("broadcast_in_dim", "broadcast_dimensions"): (
        lambda x: jnp.broadcast_to(x, (5, 3, 4)),
        (x2,),
        lambda v, e: tuple(v) == (1, 2),
    ),
    ("squeeze", "dimensions"): (
        lambda x: jnp.squeeze(x, axis=1),
        (jnp.zeros((2, 1, 4)),),
        lambda v, e: tuple(v) == (1,),
    ),
    # `dimensions` is None for a plain reshape (a transpose-reshape when not None).
    ("reshape", "dimensions"): (
        lambda x: jnp.reshape(x, (6, 4)),
        (x3,),
        lambda v, e: v is None,
    ),
    **{
        (name, "axes"): (_reduce(name), (x3,), lambda v, e: tuple(v) == (0, 2))
        for name in "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split()
    },
    ("argmax", "axes"): (
        lambda x: jnp.argmax(x, 1),
        (x3,),
        lambda v, e: tuple(v) == (1,),
    ),
    ("argmin", "axes"): (
        lambda x: jnp.argmin(x, 1),
        (x3,),
        lambda v, e: tuple(v) == (1,),
    ),
    **{
        (name, "axis"): (fn, (x3,), lambda v, e: v == 1)
        for name, fn in {
            "cumsum": lambda x: jax.lax.cumsum(x, 1),
            "cumprod": lambda x: jax.lax.cumprod(x, 1),
            "cummax": lambda x: jax.lax.cummax(x, 1),
            "cummin": lambda x: jax.lax.cummin(x, 1),
            "cumlogsumexp": lambda x: jax.lax.cumlogsumexp(x, 1),
        }.items()
    },
    ("sort", "dimension"): (lambda x: jnp.sort(x, axis=1), (x3,), lambda v, e: v == 1),
    ("rev", "dimensions"): (
        lambda x: jnp.flip(x, axis=(0, 2)),
        (x3,),
        lambda v, e: tuple(v) == (0, 2),
    ),
    # ((lhs contracting, rhs contracting), (lhs batch, rhs batch))
    ("dot_general", "dimension_numbers"): (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        (x3, jnp.zeros((2, 4, 5))),
        lambda v, e: (
            tuple(map(tuple, v[0])) == ((2,), (1,))
            and tuple(map(tuple, v[1])) == ((0,), (0,))
        ),
    ),
    **{
        ("slice", field): (
            lambda x: jax.lax.slice(x, (0, 1, 0), (2, 3, 4), (1, 2, 1)),
            (x3,),
            lambda v, e, want=want: tuple(v) == want,
        )
        for field, want in {
            "start_indices": (0, 1, 0),
            "limit_indices": (2, 3, 4),
            "strides": (1, 2, 1),
        }.items()
    },
    ("dynamic_slice", "slice_sizes"): (
        lambda x, i: jax.lax.dynamic_slice(x, (0, i, 0), (2, 2, 4)),
        (x3, 1),
        lambda v, e: tuple(v) == (2, 2, 4),
    ),
    # (low, high, interior) per axis
    ("pad", "padding_config"): (
        lambda x: jnp.pad(x, ((0, 0), (1, 2), (0, 0))),
        (x3,),
        lambda v, e: [tuple(p) for p in v] == [(0, 0, 0), (1, 2, 0), (0, 0, 0)],
    ),
    # ConvDimensionNumbers: lhs_spec[0] is the batch axis, out_spec[0] its output
    # axis, out_spec[1] the output features, rhs_spec[2:] the kernel's spatial axes.
    ("conv_general_dilated", "dimension_numbers"): (
        _conv,
        (image, kernel),
        lambda v, e: (
            tuple(v.lhs_spec) == (0, 1, 2, 3)
            and tuple(v.rhs_spec) == (0, 1, 2, 3)
            and tuple(v.out_spec) == (0, 1, 2, 3)
        ),
    ),
    ("conv_general_dilated", "batch_group_count"): (
        _conv,
        (image, kernel),
        lambda v, e: v == 1,
    ),
    ("conv_general_dilated", "feature_group_count"): (
        _conv,
        (image, kernel),
        lambda v, e: v == 1,
    ),
    ("conv_general_dilated", "window_strides"): (
        _conv,
        (image, kernel),
        lambda v, e: tuple(v) == (2, 1),
    ),
    ("conv_general_dilated", "padding"): (
        _conv,
        (image, kernel),
        lambda v, e: [tuple(p) for p in v] == [(1, 1), (0, 0)],
    ),
    ("conv_general_dilated", "lhs_dilation"): (
        _conv,
        (image, kernel),
        lambda v, e: tuple(v) == (1, 1),
    ),
    ("conv_general_dilated", "rhs_dilation"): (
        _conv,
        (image, kernel),
        lambda v, e: tuple(v) == (1, 2),
    ),
    # An embedding lookup: rows of the table, the index vector last.
    ("gather", "dimension_numbers"): (
        lambda t, i: t[i],
        (jnp.zeros((7, 4)), jnp.zeros((3,), int)),
        lambda v, e: (
            tuple(v.offset_dims) == (1,)
            and tuple(v.collapsed_slice_dims) == (0,)
            and tuple(v.start_index_map) == (0,)
            and _compat.gather_batching_dims(v) == ((), ())
        ),
    ),
    # `table[ids]` clamps an id outside the table; `jnp.take` fills (drops) it.
    ("gather", "mode"): (
        lambda t, i: t[i],
        (jnp.zeros((7, 4)), jnp.zeros((3,), int)),
        lambda v, e: v != jax.lax.GatherScatterMode.FILL_OR_DROP,
    ),
    ("gather", "slice_sizes"): (
        lambda t, i: t[i],
        (jnp.zeros((7, 4)), jnp.zeros((3,), int)),
        lambda v, e: tuple(v) == (1, 4),
    ),
    ("split", "axis"): (
        lambda x: jnp.split(x, [1], axis=1),
        (x3,),
        lambda v, e: v == 1,
    ),
    ("concatenate", "dimension"): (
        lambda x: jnp.concatenate([x, x], axis=2),
        (x3,),
        lambda v, e: v == 2,
    ),
    ("stack", "axis"): (
        lambda x: jnp.stack([x, x], axis=1),
        (x3,),
        lambda v, e: v == 1,
    ),
    **{
        (f"reduce_window_{op}", field): (
            _window(op),
            (jnp.zeros((4, 6)),),
            lambda v, e, want=want: (
                [tuple(p) if isinstance(p, tuple) else p for p in v] == want
            ),
        )
        for op in ("sum", "max", "min")
        for field, want in {
            "window_dimensions": [1, 2],
            "window_strides": [1, 2],
            "padding": [(0, 0), (0, 0)],
            "base_dilation": [1, 1],
            "window_dilation": [1, 1],
        }.items()
    },
}


def _scan_fn(c, h, xs):
    def step(h, x):
        return jnp.tanh(h * c[0] + c[1] + x), h.sum()

    return jax.lax.scan(step, h, xs, reverse=True, unroll=2)


SCAN_ARGS = ((jnp.ones(4), jnp.ones(4)), jnp.zeros(4), jnp.zeros((3, 4)))
for field, want in {"length": 3, "reverse": True, "unroll": 2}.items():
    PINS["scan", field] = (_scan_fn, SCAN_ARGS, lambda v, e, want=want: v == want)
PINS["scan", "jaxpr"] = (
    _scan_fn,
    SCAN_ARGS,
    lambda v, e: _compat.call_body_of(v) is not None,
)


# Primitives of jax 0.10 on; older JAX writes them with others (`jnp.stack` as
# `broadcast_in_dim` and `concatenate`).
NEWER = frozenset({"stack"})


def test_every_parameter_read_is_pinned():
    read = {(p, f) for p, fields in _compat.PARAMS_READ.items() for f in fields}
    assert read == set(PINS)


@pytest.mark.parametrize("pin", sorted(PINS), ids=".".join)
def test_parameter(pin):
    primitive, field = pin
    fn, args, check = PINS[pin]
    if primitive in NEWER and primitive not in str(jax.make_jaxpr(fn)(*args)):
        pytest.skip(f"jax {jax.__version__} has no `{primitive}` primitive")
    eqn = _eqn(fn, *args, primitive=primitive)
    assert field in eqn.params, (
        f"jax {jax.__version__}: `{primitive}` has no parameter `{field}` "
        f"(it has {sorted(eqn.params)})"
    )
    value = _compat.param(eqn, field)
    assert check(value, eqn), f"`{primitive}.{field}` = {value!r}"


def test_param_names_the_missing_field():
    eqn = _eqn(lambda x: jnp.transpose(x), x2, primitive="transpose")
    with pytest.raises(AssertionError, match="PARAMS_READ"):
        _compat.param(eqn, "dimension")
    moved = eqn.replace(params={})
    with pytest.raises(RuntimeError, match="`permutation` of `transpose`"):
        _compat.param(moved, "permutation")
    assert _compat.param(moved, "permutation", None) is None


def test_scan_groups():
    eqn = _eqn(_scan_fn, *SCAN_ARGS, primitive="scan")
    assert _compat.scan_counts(eqn) == (2, 1)  # two consts, one carry, one xs
    scan = _compat.scan(eqn)
    assert (scan.num_consts, scan.num_carry, scan.length) == (2, 1, 3)
    assert scan.reverse and scan.unroll == 2
    body, consts = scan.body
    assert len(body.invars) == len(eqn.invars) == 4 and consts == []


def test_scan_groups_refused_by_name():
    eqn = _eqn(_scan_fn, *SCAN_ARGS, primitive="scan")
    params = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "ft_in")}
    with pytest.raises(RuntimeError, match="cannot read this `scan`"):
        _compat.scan_counts(eqn.replace(params=params))


@jax.custom_jvp
def _cj(x):
    return jnp.sin(x)


_cj.defjvp(lambda p, t: (_cj(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cv(x):
    return jnp.sin(x)


_cv.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g,))

CALLS = {
    "jit": lambda x: jax.jit(jnp.sin)(x),
    "checkpoint": lambda x: jax.checkpoint(jnp.sin)(x),
    "custom_jvp_call": _cj,
    "custom_vjp_call": _cv,
    "filter_jit": lambda x: eqx.filter_jit(jnp.sin)(x),
}


@pytest.mark.parametrize("name", CALLS)
def test_call_bodies(name):
    jaxpr = jax.make_jaxpr(CALLS[name])(x2).jaxpr
    (eqn,) = jaxpr.eqns
    assert eqn.primitive.name in _compat.CALL_BODIES, eqn.primitive.name
    assert _compat.CALL_BODIES[eqn.primitive.name] in eqn.params
    body, consts = _compat.call_body(eqn)
    assert [e.primitive.name for e in body.eqns] == ["sin"]
    assert len(body.invars) == len(eqn.invars) and len(consts) == len(body.constvars)


def test_literals_and_dropped_outputs():
    jaxpr = jax.make_jaxpr(lambda x: x * 2.0 + x)(jnp.ones(3)).jaxpr
    mul = next(e for e in jaxpr.eqns if e.primitive.name == "mul")
    literal = next(a for a in mul.invars if _compat.is_literal(a))
    assert _compat.literal_value(literal) == 2.0
    assert not any(_compat.is_literal(v) for v in jaxpr.invars)
    assert _compat.unique_invars(mul) == [jaxpr.invars[0]]
    # jaxprs that went through dead-code elimination mark the outputs nothing reads
    # with `DropVar`s; an unread output of `make_jaxpr` (printed `_`) is a `Var`.
    eig = _eqn(lambda x: jnp.linalg.eigh(x)[1], jnp.eye(2), primitive="eigh")
    assert not any(_compat.is_drop_var(v) for v in eig.outvars)
    assert _compat.is_drop_var(_compat._DropVar(eig.outvars[0].aval))


def test_eqn_evaluator_runs_one_equation():
    jaxpr = jax.make_jaxpr(_scan_fn)(*SCAN_ARGS).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    out = _compat.eqn_evaluator(eqn)(*SCAN_ARGS[0], *SCAN_ARGS[1:])
    expected = _scan_fn(*SCAN_ARGS)
    for a, b in zip(out, jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b)


def test_eqn_evaluator_builds_its_jaxpr_with_debug_info():
    # Without one, jax (0.9 too) warns at every equation the tracer evaluates.
    jaxpr = jax.make_jaxpr(_scan_fn)(*SCAN_ARGS).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert _compat._DebugInfo is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate = _compat.eqn_evaluator(eqn)
    assert [str(w.message) for w in caught] == []
    out = evaluate(*SCAN_ARGS[0], *SCAN_ARGS[1:])
    for a, b in zip(out, jax.tree.leaves(_scan_fn(*SCAN_ARGS))):
        np.testing.assert_allclose(a, b)


def test_shape_of_atoms():
    jaxpr = jax.make_jaxpr(lambda x: x * 2.0)(x3).jaxpr
    assert _compat.shape(jaxpr.invars[0]) == (2, 3, 4)
    assert _compat.shape(jaxpr.eqns[0].invars[1]) == ()


def test_solve_of_a_model_names_the_fix_without_shape_of_non_arrays():
    # `jnp.shape` of a function (an MLP's activation) is deprecated in JAX: the
    # message for `solve(model)` (instead of its parameters) must not rely on it.
    import warnings

    import eqfisher as ef

    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    x, y = jnp.ones((5, 3)), jnp.zeros(5, dtype=int)

    def loss_fn(model, batch):
        return ef.softmax_cross_entropy(jax.vmap(model)(batch[0]), batch[1])

    curv = ef.curvature(loss_fn, model, (x, y), estimator=ef.GGN(), structure=ef.KFAC())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            ValueError, match=r"eqx\.filter\(model, eqx\.is_inexact_array\)"
        ) as e:
            curv.solve(model, 1e-3)
    assert "<function>" in str(e.value) or "<PjitFunction>" in str(e.value)
