"""Every JAX-internal detail eqfisher relies on, in one place.

CI runs jax 0.9.x, 0.10.x (Python 3.11) and the newest release (Python >= 3.12);
`tests/test_compat.py` pins every read here. Keep this module small: the rest of
eqfisher talks to jaxprs only through the names defined here.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import jaxlib.version
import numpy as np
from jax._src import core as jax_core, traceback_util
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType


Var = jex.core.Var
Literal = jex.core.Literal
Jaxpr = jex.core.Jaxpr
ClosedJaxpr = jex.core.ClosedJaxpr
Primitive = jex.core.Primitive
# jax warns (a DeprecationWarning) when a Jaxpr is built without one; jax 0.9 has
# the class only internally.
_DebugInfo = getattr(jex.core, "DebugInfo", None) or getattr(
    jax_core, "DebugInfo", None
)
JaxprEqn = jex.core.JaxprEqn


def release(version: str) -> tuple[int, int]:
    """`(major, minor)` of a version string such as `"0.10.2"` or `"0.12.0.1"`."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


JAXLIB_RELEASE = release(jaxlib.version.__version__)

# jaxlib 0.10 splits one batched LAPACK call (Cholesky, eigh, QR, SVD, LU, triangular
# solve) over the CPU thread pool that the call itself runs on, and blocks until the
# pieces are done. When as many such calls run at once as the pool has threads (two
# on a 2-core machine), every thread waits for pieces no thread is left to run: the
# program hangs. jaxlib 0.9 has no such path and 0.11 compiles it out.
# `eqfisher._linalg` runs batched factorisations one matrix at a time where it is set.
LAPACK_SPLITS_BATCHES = (0, 10) <= JAXLIB_RELEASE < (0, 11)

# Higher-order primitives whose body eqfisher may inline, with the parameter that holds
# the body. `jit` was called `pjit` before jax 0.7; `remat2` is `jax.checkpoint`.
CALL_BODIES = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def make_jaxpr(fn: Callable, *args: Any) -> tuple[Jaxpr, list[Any]]:
    """Traces `fn(*args)`; returns the open jaxpr and the values of its constvars."""
    closed = jax.make_jaxpr(fn)(*args)
    return closed.jaxpr, list(closed.consts)


def call_body(eqn: JaxprEqn) -> tuple[Jaxpr, list[Any]] | None:
    """The body of a call-like equation as `(jaxpr, consts)`, or None."""
    key = CALL_BODIES.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    return call_body_of(eqn.params[key])


def call_body_of(body: Any) -> tuple[Jaxpr, list[Any]] | None:
    """A `ClosedJaxpr` (or bare `Jaxpr`) parameter as `(jaxpr, consts)`."""
    # A ClosedJaxpr has `.jaxpr` and `.consts`; a bare Jaxpr (remat2) has neither.
    # From jax 0.11 the two classes merge: a Jaxpr then carries its own consts.
    inner = getattr(body, "jaxpr", body)
    consts = list(getattr(body, "consts", ()))
    if len(consts) != len(inner.constvars):
        return None
    return inner, consts


def sub_jaxprs(value: Any) -> list[Jaxpr]:
    """The jaxprs inside an equation parameter (a body, or a tuple of branches)."""
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in sub_jaxprs(v)]
    inner = getattr(value, "jaxpr", value)
    return [inner] if isinstance(inner, Jaxpr) else []


def scan_counts(eqn: JaxprEqn) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation.

    Before jax 0.11 they are parameters; from 0.11 the operands are described by
    `ft_in`, one group each for the constants, the carry and the scanned inputs.
    """
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    groups = _scan_groups(p.get("ft_in"))
    if groups is None or len(groups) != 3:
        raise RuntimeError(
            f"eqfisher cannot read this `scan` equation's parameters on jax "
            f"{jax.__version__} ({sorted(p)}); please report it."
        )
    return len(groups[0]), len(groups[1])


def _scan_groups(ft_in: Any) -> tuple[Any, ...] | None:
    # jax 0.11 stores the groups as a tuple of tuples; from 0.12 `ft_in` is a
    # `FlatTree` whose `unpack()` gives the groups (indexing it gives leaves).
    if ft_in is None:
        return None
    if hasattr(ft_in, "unpack"):
        return tuple(ft_in.unpack())
    return tuple(ft_in)


class Scan(NamedTuple):
    """What eqfisher reads of a `scan` equation."""

    body: tuple[Jaxpr, list[Any]] | None  # `(jaxpr, consts)`, as `call_body_of`
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan(eqn: JaxprEqn) -> Scan:
    """The parameters of a `scan` equation that eqfisher reads."""
    num_consts, num_carry = scan_counts(eqn)
    return Scan(
        call_body_of(param(eqn, "jaxpr")),
        num_consts,
        num_carry,
        param(eqn, "length"),
        param(eqn, "reverse"),
        param(eqn, "unroll", 1),
    )


_WINDOW = frozenset(
    {
        "window_dimensions",
        "window_strides",
        "padding",
        "base_dilation",
        "window_dilation",
    }
)
_CONV = frozenset(
    {
        "dimension_numbers",
        "batch_group_count",
        "feature_group_count",
        "window_strides",
        "padding",
        "lhs_dilation",
        "rhs_dilation",
    }
)

# The parameters of JAX's primitives that eqfisher reads, by primitive. Each is
# pinned by `tests/test_compat.py` (present, and of the form eqfisher assumes), so a
# JAX release that renames or reshapes one fails a test that names it; `param`
# refuses to read one that is not listed here.
PARAMS_READ: dict[str, frozenset[str]] = {
    "transpose": frozenset({"permutation"}),
    "broadcast_in_dim": frozenset({"broadcast_dimensions"}),
    "squeeze": frozenset({"dimensions"}),
    "reshape": frozenset({"dimensions"}),
    **dict.fromkeys(
        "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
        "argmax argmin".split(),
        frozenset({"axes"}),
    ),
    **dict.fromkeys(
        "cumsum cumprod cummax cummin cumlogsumexp".split(), frozenset({"axis"})
    ),
    "sort": frozenset({"dimension"}),
    "rev": frozenset({"dimensions"}),
    "dot_general": frozenset({"dimension_numbers"}),
    "slice": frozenset({"start_indices", "limit_indices", "strides"}),
    "dynamic_slice": frozenset({"slice_sizes"}),
    "pad": frozenset({"padding_config"}),
    "conv_general_dilated": _CONV,
    "gather": frozenset({"dimension_numbers", "slice_sizes", "mode"}),
    "split": frozenset({"axis"}),
    "concatenate": frozenset({"dimension"}),
    "stack": frozenset({"axis"}),  # a primitive from jax 0.10 on
    **dict.fromkeys(
        "reduce_window_sum reduce_window_max reduce_window_min".split(), _WINDOW
    ),
    "scan": frozenset({"jaxpr", "length", "reverse", "unroll"}),
}

_REQUIRED: Any = object()


def param(eqn: JaxprEqn, name: str, default: Any = _REQUIRED) -> Any:
    """The parameter `name` of a JAX primitive's equation (listed in `PARAMS_READ`).

    A parameter that this JAX does not have raises a `RuntimeError` naming it,
    unless a `default` is given (for parameters older JAX releases lack).
    """
    prim = eqn.primitive.name
    if name not in PARAMS_READ.get(prim, ()):
        raise AssertionError(
            f"eqfisher reads `{prim}`'s parameter `{name}`: list it in "
            "`_compat.PARAMS_READ`, and pin it in tests/test_compat.py."
        )
    if name in eqn.params:
        return eqn.params[name]
    if default is not _REQUIRED:
        return default
    raise RuntimeError(
        f"eqfisher reads the parameter `{name}` of `{prim}` equations, which jax "
        f"{jax.__version__} does not have (it has {sorted(eqn.params)}); please "
        "report it."
    )


def gather_batching_dims(dn: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(operand_batching_dims, start_indices_batching_dims)` of a gather's
    dimension numbers: the axes gathered one-to-one (a vmapped index)."""
    return tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)


def shape(atom: Any) -> tuple[int, ...]:
    """The shape of a jaxpr variable or literal (`()` for abstract tokens)."""
    return tuple(getattr(atom.aval, "shape", ()))


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def constant_output(value: Any, aval: Any) -> Any:
    """A constant output of a traced function as `jax.jit` returns it: an array of
    the output's dtype, weakly typed where the output is. A jaxpr's literal holds
    a Python scalar (`bool`, jax's `TypedFloat`, ...): returned as it is, it would
    be a static value to `eqx.filter_jit` and a new compile whenever it is passed
    back in (a BatchNorm state's flag). `jnp.asarray` of a Python scalar is weakly
    typed, of anything with a dtype not."""
    kind = {"b": bool, "i": int, "u": int, "f": float, "c": complex}
    python = kind.get(np.dtype(aval.dtype).kind)  # None for bfloat16, say
    if getattr(aval, "weak_type", False) and np.ndim(value) == 0 and python:
        scalar = jnp.asarray(python(value))
        if scalar.dtype == aval.dtype:
            return scalar
    return jnp.asarray(value, dtype=aval.dtype)


def eqn_evaluator(eqn: JaxprEqn) -> Callable[..., list[Any]]:
    """A function evaluating one equation on the values of its non-literal invars.

    The equation is wrapped in a one-equation closed jaxpr and run with
    `jaxpr_as_fun`: this works unchanged for first-order primitives and for `jit`,
    `remat2`, `custom_jvp_call`, `custom_vjp_call`, `scan`, `cond` and `while`,
    without re-binding higher-order primitives by hand (what broke kfac_jax on 0.10).
    The returned function takes the values of `unique_invars(eqn)` in order.
    """
    invars = unique_invars(eqn)
    if _DebugInfo is None:
        jaxpr = Jaxpr([], invars, list(eqn.outvars), [eqn], eqn.effects)
    else:
        info = _DebugInfo("eqfisher", eqn.primitive.name, None, None)
        jaxpr = Jaxpr([], invars, list(eqn.outvars), [eqn], eqn.effects, info)
    return jex.core.jaxpr_as_fun(ClosedJaxpr(jaxpr, []))


def unique_invars(eqn: JaxprEqn) -> list[Var]:
    seen: set[int] = set()
    out = []
    for v in eqn.invars:
        if is_literal(v) or id(v) in seen:
            continue
        seen.add(id(v))
        out.append(v)
    return out


# `jax.extend.core` exports `DropVar` from jax 0.10 only.
try:
    from jax.extend.core import DropVar as _DropVar
except ImportError:
    from jax._src.core import DropVar as _DropVar


def is_drop_var(v: Any) -> bool:
    return isinstance(v, _DropVar)


def define_identity_primitive(
    name: str, jvp_rule: Callable, batch_rule: Callable
) -> Primitive:
    """A primitive returning its first operand; the others are carried metadata."""
    prim = Primitive(name)
    prim.def_impl(lambda x, *rest, **params: x)
    prim.def_abstract_eval(lambda x, *rest, **params: x)
    ad.primitive_jvps[prim] = jvp_rule
    batching.primitive_batchers[prim] = batch_rule
    mlir.register_lowering(
        prim, mlir.lower_fun(lambda x, *rest, **params: x, multiple_results=False)
    )
    return prim


def define_marker_primitive(name: str) -> Primitive:
    """An identity primitive on one array that differentiates and batches as the
    identity: a mark on a value that the tracer can find in a jaxpr."""

    def jvp_rule(primals, tangents):
        return prim.bind(*primals), ad.instantiate_zeros(tangents[0])

    def batch_rule(args, dims):
        (x,), (d,) = args, dims
        return prim.bind(batching.bdim_at_front(x, d, x.shape[d])), 0

    prim = define_identity_primitive(name, jvp_rule, batch_rule)
    return prim


def _varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside `jax.shard_map` (`{V:data}` in
    its type): the aval's `vma` to jax 0.9, `mat.varying` from jax 0.10."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(axes or ())


def explicit_axes(x: Any) -> frozenset[str]:
    """The mesh axes of type `Explicit` (`jax.make_mesh`'s default) that `x`'s type
    is sharded over (`float32[8@data]`): none for an `Auto` mesh's array."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return frozenset()
    kinds = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    named = (
        a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))
    )
    return frozenset(
        a for a in named if isinstance(a, str) and kinds.get(a) == AxisType.Explicit
    )


def manual_axes() -> frozenset[str]:
    """The `Manual` mesh axes this runs under: those of the enclosing
    `jax.shard_map`s, with either `check_vma`."""
    mesh = jax.sharding.get_abstract_mesh()
    kinds = zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
    return frozenset(name for name, kind in kinds if kind == AxisType.Manual)


def in_manual_mesh() -> bool:
    """Whether this runs inside `jax.shard_map`."""
    return bool(manual_axes())


def is_varying(x: Any) -> bool:
    """Whether `x` varies over a manual mesh axis (inside `jax.shard_map`)."""
    return bool(_varying_axes(x))


def instantiate_zeros(tangent: Any) -> Any:
    return ad.instantiate_zeros(tangent)


def move_batch_axis(x: Any, bdim: Any, size: int) -> Any:
    """Moves a vmapped operand's batch axis to 0, broadcasting unbatched ones."""
    return batching.bdim_at_front(x, bdim, size)


def hide_frames(path: str) -> None:
    """Leaves the frames of files under `path` out of the tracebacks JAX shows
    (`JAX_TRACEBACK_FILTERING`), as Equinox does for its own."""
    traceback_util.register_exclusion(path)
