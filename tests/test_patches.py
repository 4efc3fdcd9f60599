"""`conv_patches` (pad and strided slices) equals `jax.lax.conv_general_dilated_patches`
element for element, for every layout, stride, padding and dilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqfisher.internal import conv_patches


CASES = [
    # (input shape, kernel, strides, padding, lhs dilation, rhs dilation, layouts)
    ((3, 2, 8, 8), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), None),
    ((3, 2, 9, 7), (3, 2), (2, 1), ((0, 2), (1, 0)), (1, 1), (1, 1), None),
    ((2, 3, 10, 10), (3, 3), (1, 2), ((2, 2), (2, 2)), (1, 1), (2, 2), None),
    ((2, 3, 5, 6), (2, 3), (1, 1), ((1, 1), (0, 1)), (2, 1), (1, 1), None),
    ((2, 3, 9, 9), (3, 3), (2, 2), ((-1, 0), (1, -1)), (1, 1), (1, 1), None),
    (
        (2, 8, 8, 3),
        (3, 3),
        (1, 1),
        ((1, 1), (1, 1)),
        (1, 1),
        (1, 1),
        ("NHWC", "HWIO", "NHWC"),
    ),
    (
        (2, 8, 8, 3),
        (3, 3),
        (2, 1),
        ((1, 1), (1, 1)),
        (1, 1),
        (1, 1),
        ("NHWC", "OIHW", "NCHW"),
    ),
    ((4, 3, 17), (5,), (2,), ((2, 2),), (1,), (3,), None),
    (
        (2, 2, 4, 5, 6),
        (2, 3, 2),
        (1, 2, 1),
        ((1, 0), (1, 1), (0, 1)),
        (1, 1, 1),
        (1, 1, 2),
        None,
    ),
    (
        (2, 3, 2, 2),
        (3, 3),
        (1, 1),
        ((0, 0), (0, 0)),
        (1, 1),
        (1, 1),
        None,
    ),  # empty output
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_conv_patches_equal_lax(case):
    shape, kernel, strides, padding, lhs_dil, rhs_dil, layouts = case
    x = jax.random.normal(jax.random.key(0), shape, jnp.float64)
    rhs_shape = (1, 1) + tuple(kernel)  # only the kernel's spatial size matters
    if layouts is not None:
        rhs_shape = tuple(
            {"O": 1, "I": 1}.get(ch, 0) or kernel["HWD".index(ch)] for ch in layouts[1]
        )
    dn = jax.lax.conv_dimension_numbers(shape, rhs_shape, layouts)
    expected = jax.lax.conv_general_dilated_patches(
        x,
        kernel,
        strides,
        padding,
        lhs_dil,
        rhs_dil,
        dn,
        precision=jax.lax.Precision.HIGHEST,
    )
    got = conv_patches(x, kernel, strides, padding, lhs_dil, rhs_dil, dn)
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(expected), rtol=0, atol=1e-13
    )
