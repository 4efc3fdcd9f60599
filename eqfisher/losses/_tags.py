"""The loss tags: identity primitives that mark, for eqfisher's tracer, a
registered loss's inputs (with its family, targets and weights) and its value."""

from .. import _compat


def _tag_jvp(primals, tangents, *, family):
    inputs_dot = _compat.instantiate_zeros(tangents[0])
    return loss_tag_p.bind(*primals, family=family), inputs_dot


def _tag_batch(args, dims, *, family):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)
    args = [
        _compat.move_batch_axis(a, d, size) for a, d in zip(args, dims, strict=False)
    ]
    return loss_tag_p.bind(*args, family=family), 0


loss_tag_p = _compat.define_identity_primitive(
    "eqfisher_loss_tag", _tag_jvp, _tag_batch
)
loss_tag_p.__doc__ = """Identity on `inputs`; operands `(inputs, targets, mask)`."""


# The k-th value tag of a program marks the value of the k-th registered loss, so
# that the tracer can see how the value `loss_fn` returns depends on it.
loss_value_tag_p = _compat.define_marker_primitive("eqfisher_loss_value_tag")
loss_value_tag_p.__doc__ = """Identity on a registered loss's scalar value."""
