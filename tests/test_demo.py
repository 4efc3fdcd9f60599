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
    assert "steps to loss 0.15" in text and "test loss" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # two panels with curves, not an empty figure


def test_demo_rejects_bad_steps(capsys):
    with pytest.raises(SystemExit):
        internal.main(["demo", "--steps", "0"])
    err = capsys.readouterr().err
    assert "--steps must be positive" in err
    assert "usage: eqfisher demo" in err  # the demo's own usage


def test_demo_rejects_a_plot_file_matplotlib_cannot_write_before_training(
    tmp_path, capsys, monkeypatch
):
    import eqfisher._demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda *a: pytest.fail("trained"))
    with pytest.raises(SystemExit):
        internal.main(["demo", "--out", str(tmp_path / "plot.txt")])
    assert "matplotlib writes no .txt file" in capsys.readouterr().err


def test_demo_plot_labels_the_target(tmp_path, monkeypatch):
    import types

    import matplotlib.pyplot as plt

    from eqfisher import _demo

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    run = types.SimpleNamespace(
        name="K-FAC (eqfisher)", steps=[0, 1], seconds=[0.0, 0.1], losses=[1.0, 0.01]
    )
    _demo._plot([run], tmp_path / "plot.png")
    (fig,) = figures
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["K-FAC (eqfisher)", f"target loss {_demo.TARGET_LOSS}"]
    monkeypatch.undo()
    plt.close(fig)


def test_demo_progress_bars_redraw_at_their_own_pace(tmp_path, capsys):
    # Captured output (a log, a pipe): each bar is redrawn at tqdm's `mininterval`,
    # a few times for the whole run, not once per step (which wrote thirty
    # carriage-return segments per optimiser here).
    out = tmp_path / "plot.png"
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        argv = ["demo", "--steps", "30", "--out", str(out), "--seed", "1"]
        assert internal.main(argv) == 0
    captured = capsys.readouterr()
    assert "steps to loss 0.15" in captured.out
    bars = captured.out + captured.err
    assert "30/30" in bars  # each bar's last state is still drawn
    assert bars.count("step/s") < 30
