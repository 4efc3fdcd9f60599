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
    assert "argument --steps: must be positive, got 0" in err
    assert "usage: eqfisher demo" in err  # the demo's own usage


def test_demo_rejects_a_plot_file_matplotlib_cannot_write_before_training(
    tmp_path, capsys, monkeypatch
):
    import eqfisher._demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda *a: pytest.fail("trained"))
    with pytest.raises(SystemExit):
        internal.main(["demo", "--out", str(tmp_path / "plot.txt")])
    assert "matplotlib writes no .txt file" in capsys.readouterr().err


def test_demo_checks_pgf_needs_latex_before_training(tmp_path, capsys, monkeypatch):
    """PGF without LaTeX passed the check (an empty figure needs no LaTeX), and
    the demo failed with a traceback after the training."""
    import shutil

    import matplotlib

    import eqfisher._demo as demo

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda steps, path, seed: seen.append(path))
    out = tmp_path / "plot.pgf"
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        with pytest.raises(SystemExit) as info:
            internal.main(["demo", "--out", str(out)])
        assert info.value.code == 2 and not seen
        assert "matplotlib cannot write .pgf here" in capsys.readouterr().err
    else:
        assert internal.main(["demo", "--out", str(out)]) == 0 and seen == [out]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seed", "-1"], "argument --seed: must be in [0, 2**32 - 1], got -1"),
        (["--seed", str(2**32)], "argument --seed: must be in [0, 2**32 - 1]"),
        (["--out", "{tmp}"], "it is a folder; name a file in it"),
        (["--out", "{tmp}/file.png/plot.png"], "file.png is not a folder"),
    ],
)
def test_demo_rejects_bad_arguments_before_training(
    tmp_path, capsys, monkeypatch, argv, message
):
    # A seed scikit-learn refuses, or a plot path that cannot be written, failed
    # with a traceback after the training (the seed 6 s in, the path 15-30 s).
    import eqfisher._demo as demo

    (tmp_path / "file.png").write_bytes(b"")
    monkeypatch.setattr(demo, "run_demo", lambda *a: pytest.fail("trained"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as info:
        internal.main(["demo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: eqfisher demo" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.png"]  # nothing left


def test_demo_checks_a_new_plot_path_without_leaving_a_file(tmp_path, monkeypatch):
    import eqfisher._demo as demo

    out = tmp_path / "new" / "plot.png"
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda steps, path, seed: seen.append(path))
    assert internal.main(["demo", "--out", str(out)]) == 0
    assert seen == [out] and not out.exists()


def test_demo_without_its_extras_says_so_on_stderr(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "eqfisher._demo", None)  # import fails
    assert internal.main(["demo"]) == 1
    captured = capsys.readouterr()
    assert "pip install 'eqfisher[demo]'" in captured.err and not captured.out


def test_version_and_python_m():
    import subprocess
    import sys

    import eqfisher

    run = subprocess.run(
        [sys.executable, "-m", "eqfisher", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == f"eqfisher {eqfisher.__version__}"


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
