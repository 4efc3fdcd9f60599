"""Settings that change how eqfisher traces a loss, read at trace time.

`eqfisher.configure(...)` changes them for the code inside a `with` block (or,
called as a statement, from the call on);
`eqfisher.current_config()` reads them. A traced loss is cached per configuration,
so changing a setting retraces.
"""

import contextlib
import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """eqfisher's settings.

    **Fields:**

    - `max_unroll`: a `jax.lax.scan` that reads parameters stays a scan, whatever
      its length, and the layers of every step are found on its body. The scans
      that cannot stay one (a scan nested in a scan over stacked leaves, a
      parameter in the carry, a loss registered inside the body) are unrolled
      instead when they have at most this many steps (default 128); longer ones
      stay opaque and their parameters get diagonal blocks, because unrolling
      would make the traced program (and its compile time) grow with the number
      of steps.
    - `max_patch_elements`: K-FAC forms a convolution's patch matrix for a chunk of
      examples at a time when the whole matrix would hold more elements than this
      (default 2**20), so that memory stays bounded however large the batch.

    !!! Example

        A convolution's K-FAC factors, with the patch matrix (8 examples x 16
        locations x 9 inputs) formed whole, then in chunks: the same factors.

        ```python
        conv = eqx.nn.Conv2d(1, 2, 3, key=key)
        images = jax.random.normal(key, (8, 1, 6, 6))

        def conv_loss(conv, images):
            out = jax.vmap(conv)(images).reshape(len(images), -1)  # (8, 2 * 4 * 4)
            return ef.squared_error(out, jnp.zeros_like(out))

        def kfac():
            return ef.curvature(
                conv_loss, conv, images, estimator=ef.GGN(), structure=ef.KFAC()
            ).as_matrix()

        assert ef.current_config() == ef.Config()  # the defaults
        whole = kfac()
        with ef.configure(max_patch_elements=200) as config:
            assert config == ef.Config(max_patch_elements=200)
            chunked = kfac()
        assert jnp.allclose(whole, chunked, rtol=1e-5, atol=1e-5)
        ```
    """

    max_unroll: int = 128
    max_patch_elements: int = 2**20

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"`eqfisher.configure({field.name}={value!r})`: "
                    f"`{field.name}` must be a positive integer."
                )


# `Config` is frozen, so one shared default is safe.
_CURRENT = contextvars.ContextVar("eqfisher_config", default=Config())  # noqa: B039


def current_config() -> Config:
    """The settings in effect (see `eqfisher.Config`).

    !!! Example

        ```python
        assert ef.current_config().max_unroll == 128  # the default
        with ef.configure(max_unroll=16):
            assert ef.current_config().max_unroll == 16
        assert ef.current_config().max_unroll == 128  # restored
        ```
    """
    return _CURRENT.get()


class _Configured(contextlib.AbstractContextManager):
    """What `configure` returns: its settings are in effect from the call; as a
    context manager, until the end of the `with` block."""

    def __init__(self, token: contextvars.Token):
        self._token = token

    def __enter__(self) -> Config:
        return _CURRENT.get()

    def __exit__(self, *exc_info) -> None:
        _CURRENT.reset(self._token)


def configure(**changes: int) -> contextlib.AbstractContextManager[Config]:
    """Changes eqfisher's settings: inside a `with` block, or from the call on.

    **Arguments:**

    - `**changes`: new values for fields of `eqfisher.Config`, e.g.
      `max_unroll=16`.

    **Returns:**

    A context manager; it yields the `eqfisher.Config` in effect inside the block,
    and restores the settings before the call at its end. Called as a statement,
    `ef.configure(max_unroll=1024)` changes the settings for the rest of the
    program (of the thread, or of the enclosing `with` block).

    !!! Example

        ```python
        with ef.configure(max_unroll=1024) as config:
            curv = ef.curvature(
                loss_fn, model, batch, estimator=ef.GGN(), structure=ef.KFAC()
            )
        assert config.max_unroll == 1024
        assert ef.current_config().max_unroll == 128  # restored after the block
        ```

    Settings are read when a loss is traced, so under `jax.jit` the setting must
    be in effect around the traced call.
    """
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(
            f"`eqfisher.configure({unknown[0]}=...)`: no such setting; the settings "
            f"are {', '.join(f'`{n}`' for n in sorted(names))}."
        )
    return _Configured(_CURRENT.set(dataclasses.replace(_CURRENT.get(), **changes)))
