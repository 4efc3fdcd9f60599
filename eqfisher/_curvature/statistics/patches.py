"""Convolution patches by padding and strided slices.

`jax.lax.conv_general_dilated_patches` forms the patches with a convolution by an
identity kernel, which XLA:CPU runs far slower than the copies it amounts to
(benchmarks/conv_patches.py; figures in benchmarks/RESULTS.md). `conv_patches` returns the same array, element for element, from one
`lax.pad` (the conv's padding and input dilation) and one strided `lax.slice` per
kernel offset.
"""

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


def _canonical(x: Array, spec: Sequence[int]) -> Array:
    """`x` with its axes in the order `spec` names (batch, feature, spatial...)."""
    return jnp.transpose(x, tuple(spec))


def _output_size(size: int, kernel: int, stride: int, dilation: int) -> int:
    return max(0, (size - (kernel - 1) * dilation - 1) // stride + 1)


def conv_patches(
    x: Array,
    kernel: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    dimension_numbers: jax.lax.ConvDimensionNumbers,
) -> Array:
    """What `jax.lax.conv_general_dilated_patches(x, kernel, window_strides,
    padding, lhs_dilation, rhs_dilation, dimension_numbers)` returns: the output
    laid out as `dimension_numbers.out_spec`, its feature axis of size
    `channels * prod(kernel)` ordered channel-major, then the kernel offsets."""
    dn = dimension_numbers
    xc = _canonical(x, dn.lhs_spec)  # (batch, channels, *spatial)
    n, c = xc.shape[:2]
    config = [(0, 0, 0), (0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)
    ]
    xp = jax.lax.pad(xc, jnp.zeros((), xc.dtype), config)
    out = [
        _output_size(size, k, s, d)
        for size, k, s, d in zip(xp.shape[2:], kernel, window_strides, rhs_dilation)
    ]
    windows = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        start = [o * d for o, d in zip(offset, rhs_dilation)]
        limit = [b + (m - 1) * s + 1 for b, m, s in zip(start, out, window_strides)]
        windows.append(
            jax.lax.slice(
                xp,
                (0, 0, *start),
                (n, c, *[max(b, lim) for b, lim in zip(start, limit)]),
                (1, 1, *window_strides),
            )
        )
    patches = jnp.stack(windows, axis=2).reshape(n, c * math.prod(kernel), *out)
    # Canonical (batch, feature, *spatial) to the layout `out_spec` names.
    return jnp.transpose(patches, tuple(np.argsort(dn.out_spec)))
