"""`eqfisher demo` in a smoke mode: the table and the PNG are produced."""

import jax
import pytest

from eqfisher import internal


def test_demo_smoke(tmp_path, capsys):
    out = tmp_path / "plot.png"
    # The demo runs with JAX's defaults (float32, standard promotion), not the
    # suite's float64 and strict promotion (optax's Adam mixes dtypes under them).
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        argv = ["demo", "--steps", "12", "--out", str(out), "--seed", "1"]
        assert internal.main(argv) == 0
    text = capsys.readouterr().out
    assert "K-FAC (eqfisher)" in text and "Adam" in text
    assert "steps to loss 0.05" in text and "test acc" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # two panels with curves, not an empty figure


def test_demo_rejects_bad_steps(capsys):
    with pytest.raises(SystemExit):
        internal.main(["demo", "--steps", "0"])
    assert "--steps must be positive" in capsys.readouterr().err
