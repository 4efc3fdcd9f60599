"""Convolutions evaluated in the layout whose derivative XLA:CPU runs fast anywhere.

XLA:CPU gives a convolution its fast (Eigen) form, channels-last input and output
and an HWIO kernel, by layout assignment, which reaches only the entry
computation: inside a `lax.cond` branch or a loop body, a convolution written
NCHW/OIHW (Equinox's layout) runs as a naive loop nest, 2.5-5x slower
(benchmarks/RESULTS.md, "Issue 26, eleventh session"). `kfac_step` pulls its
statistics' cotangents back through the model inside a `cond`: through the
transposes of the model's convolutions.

`conv_evaluator` evaluates a convolution equation with its input and output
channels-last and its kernel HWOI (explicit transposes around it): the same
values, and JAX's transpose of it, the input's cotangent, is then a convolution of
a channels-last cotangent with an HWIO kernel, XLA:CPU's fast form without layout
assignment (jax-ml/jax#12868). In the entry computation XLA lays out both forms
alike. A whole `kfac_step` inside a `lax.scan` over steps runs as fast either way
(the HWOI forward and its kernel's cotangent are slower inside a loop, the
statistics' pull-back faster). A kept scan's body (`flatten._as_written`) keeps
its convolutions as written: forward and cotangents are all in the loop there.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _compat
from .types import Node, Program, ScanNode


def _canonical(spec: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation to (batch or output, *spatial, feature or input) of an array
    whose axes `spec` names (batch, feature, *spatial)."""
    return (spec[0], *spec[2:], spec[1])


def conv_evaluator(eqn: Any) -> Callable[..., list[Any]] | None:
    """An evaluator (as `_compat.eqn_evaluator`'s) of a `conv_general_dilated`
    equation that computes it channels-last with an HWOI kernel on the CPU; None
    for other equations, grouped convolutions, and operands that are literals or
    one variable twice."""
    if eqn.primitive.name != "conv_general_dilated":
        return None
    ungrouped = all(
        _compat.param(eqn, name) == 1
        for name in ("feature_group_count", "batch_group_count")
    )
    if not ungrouped or len(_compat.unique_invars(eqn)) != 2:
        return None
    dn = _compat.param(eqn, "dimension_numbers")
    lhs_perm, out_perm = _canonical(dn.lhs_spec), _canonical(dn.out_spec)
    # (*spatial, output, input): the transpose's kernel is then (*spatial, in, out).
    rhs_perm = (*dn.rhs_spec[2:], dn.rhs_spec[0], dn.rhs_spec[1])
    k = len(dn.lhs_spec) - 2
    channels_last = (0, k + 1, *range(1, k + 1))
    relaid = _relaid(
        eqn,
        (lhs_perm, rhs_perm, out_perm),
        jax.lax.ConvDimensionNumbers(
            lhs_spec=channels_last,
            rhs_spec=(k, k + 1, *range(k)),
            out_spec=channels_last,
        ),
    )
    original = _compat.eqn_evaluator(eqn)

    def evaluate(lhs, rhs) -> list[Any]:
        if jax.default_backend() != "cpu":
            return original(lhs, rhs)
        return relaid(lhs, rhs)

    return evaluate


def _relaid(
    eqn: Any, perms: tuple[tuple[int, ...], ...], dimension_numbers: Any
) -> Callable[..., list[Any]]:
    """The convolution of `eqn` on its input and kernel transposed by `perms[0]`
    and `perms[1]`, with `dimension_numbers` for those layouts, and its output
    transposed back from `perms[2]`: the same values in another layout."""
    lhs_perm, rhs_perm, out_perm = perms
    params = dict(eqn.params)
    params["dimension_numbers"] = dimension_numbers
    back = tuple(int(i) for i in np.argsort(out_perm))

    def evaluate(lhs, rhs) -> list[Any]:
        out = eqn.primitive.bind(
            jnp.transpose(lhs, lhs_perm), jnp.transpose(rhs, rhs_perm), **params
        )
        return [jnp.transpose(out, back)]

    return evaluate


def _portable_evaluator(eqn: Any) -> Callable[..., list[Any]] | None:
    """An evaluator of a `conv_general_dilated` equation that computes it with its
    operands and output in the order (batch or output, feature or input, *spatial),
    Equinox's NCHW / OIHW; None for other equations, and operands that are literals
    or one variable twice."""
    if eqn.primitive.name != "conv_general_dilated":
        return None
    if len(_compat.unique_invars(eqn)) != 2:
        return None
    dn = _compat.param(eqn, "dimension_numbers")
    canonical = tuple(range(len(dn.lhs_spec)))
    return _relaid(
        eqn,
        (dn.lhs_spec, dn.rhs_spec, dn.out_spec),
        jax.lax.ConvDimensionNumbers(
            lhs_spec=canonical, rhs_spec=canonical, out_spec=canonical
        ),
    )


def portable(program: Program) -> Program:
    """`program` with every convolution evaluated NCHW / OIHW (`_portable_evaluator`),
    in scan bodies too: for passes `vmap`-ped over examples. The per-example
    weight cotangent of a convolution is then a grouped convolution (one group per
    example), and XLA's SPMD partitioner computes that wrongly, without an error,
    for some layouts when the examples are sharded: channels-last input with an
    HWIO, HWOI or IOHW kernel (the `conv_evaluator` form, and Flax's), or a channels-first
    one with HWIO (jax 0.10.2 and 0.12; relative error 1). NCHW / OIHW is right
    with every input layout tried."""
    return dataclasses.replace(program, nodes=_portable_nodes(program.nodes))


def _portable_nodes(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    out = []
    for node in nodes:
        fn = _portable_evaluator(node.eqn)
        if fn is not None:
            node = dataclasses.replace(node, fn=fn)
        if isinstance(node, ScanNode):
            node = dataclasses.replace(node, body=_portable_nodes(node.body))
        out.append(node)
    return tuple(out)
