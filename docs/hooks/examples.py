"""MkDocs hook: one page per example script, with the output of a real run.

At every build each script in `examples/` is run (`--smoke`: small data, few steps,
so the whole set takes about two minutes on two cores), and its page is generated
from the script's module docstring (its single source: the docstring writes its
formulas as KaTeX, `$...$` and `$$` blocks, which the page renders), the notes on
the full run in `notes/NAME.md` where there are any, its printed output, the plots
it wrote and its full source: what the site shows cannot drift from what the code
does. `eqfisher demo` runs too (its full run: about ten seconds of training), for
its table and PNG.

Results are cached under `~/.cache/eqfisher-docs/` by the hash of the script, the
package sources and the Python executable, so `mkdocs serve` reruns only what
changed. A script that fails fails the build.
"""

import concurrent.futures
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap

from mkdocs.structure.files import File, Files


log = logging.getLogger("mkdocs.hooks.examples")
ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
CACHE = pathlib.Path(
    os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")
) / ("eqfisher-docs")
# Two workers: CI and the developers' machines have two cores.
WORKERS = 2
TIMEOUT_S = 900


def _sources_hash(*extra: pathlib.Path) -> str:
    h = hashlib.sha256(sys.executable.encode())
    files = sorted((ROOT / "eqfisher").rglob("*.py")) + [ROOT / "pyproject.toml"]
    for f in [*files, *extra]:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _run(name: str, argv: list[str], extra: list[pathlib.Path]) -> pathlib.Path:
    """Runs `argv` in a fresh folder; returns the folder (stdout.txt and files)."""
    out = CACHE / f"{name}-{_sources_hash(*extra)}"
    if (out / "ok").exists():
        return out
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"eqfisher-docs-{name}-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    log.info("running %s (for the docs)", " ".join(argv))
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"docs: `{' '.join(argv)}` failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    (tmp / "stdout.txt").write_text(proc.stdout)
    (tmp / "ok").write_text("")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(tmp, out)
    return out


def _versions() -> str:
    import jax  # noqa: PLC0415

    return (
        f"eqfisher {importlib.metadata.version('eqfisher')}, jax {jax.__version__}, "
        f"Python {platform.python_version()}, {jax.default_backend().upper()}"
    )


def _docstring(path: pathlib.Path) -> tuple[str, str]:
    import ast  # noqa: PLC0415

    doc = ast.get_docstring(ast.parse(path.read_text())) or path.stem
    title, _, body = doc.partition("\n")
    return title.rstrip("."), body.strip()


def _intro(body: str) -> str:
    """The page's introduction: the docstring's body without its "Run it with ..."
    paragraph (the page says how to run the script).

    The docstring's formulas are KaTeX, so the same text reads in a terminal and
    renders on the page (tests/test_docs_maths.py checks them).
    """
    paragraphs = body.split("\n\n")
    return "\n\n".join(p for p in paragraphs if not p.startswith("Run it with"))


def _example_page(path: pathlib.Path, run: pathlib.Path, versions: str) -> str:
    title, body = _docstring(path)
    name = path.stem
    body = _intro(body)
    pngs = sorted(p.name for p in run.glob("*.png"))
    notes = ROOT / "docs" / "hooks" / "notes" / f"{name}.md"
    lines = [
        f"# {title}",
        "",
        body,
        "",
        f"Source: `examples/{name}.py`. The full run: `python examples/{name}.py`.",
        "",
    ]
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    lines += [
        "## Output of the small run",
        "",
        '!!! note "What this output is"',
        f"    The printed output of `python examples/{name}.py --smoke`, run when "
        f"this page was built ({versions}). The smoke run uses smaller data, a "
        "smaller model and fewer steps than the full run, so its numbers are not "
        "the full run's. The test suite runs the same smoke mode and checks its "
        "results (`tests/test_examples.py`).",
        "",
        "```text",
        (run / "stdout.txt").read_text().rstrip() or "(no output)",
        "```",
        "",
    ]
    for png in pngs:
        lines += [f"![{png}, from the small run]({name}/{png})", ""]
    lines += [
        "## The code",
        "",
        f'```python title="examples/{name}.py"',
        path.read_text().rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _demo_page(run: pathlib.Path, versions: str) -> str:
    text = (run / "stdout.txt").read_text().rstrip()
    return "\n".join(
        [
            "# The demo: K-FAC against Adam",
            "",
            "`eqfisher demo` trains the same MLP (64-128-128-10, ReLU) on "
            "scikit-learn's digits data with K-FAC (`ef.optim.kfac_step`, Monte-Carlo "
            "Fisher, every option but the learning rate at its default) and with "
            "Adam, each at the best learning rate of the same grid "
            "(`benchmarks/kfac_defaults.py`), and reports the steps and seconds "
            "each needs to reach a training loss of 0.05. It is the README's first "
            "command:",
            "",
            "```bash",
            'pip install -e ".[demo]" && eqfisher demo',
            "```",
            "",
            "## Output",
            "",
            '!!! note "What this output is"',
            "    The full run of `eqfisher demo` (200 steps per optimiser), run when "
            f"this page was built ({versions}). Seconds depend on the machine "
            "and on its load when the site was built; the steps do not.",
            "",
            "```text",
            text,
            "```",
            "",
            "![Training loss of K-FAC and Adam against steps and seconds]"
            "(demo/eqfisher-demo.png)",
            "",
            '??? example "The code: `eqfisher/_demo.py`"',
            "",
            '    ```python title="eqfisher/_demo.py"',
            textwrap.indent(
                (ROOT / "eqfisher" / "_demo.py").read_text().rstrip(), "    "
            ),
            "    ```",
            "",
        ]
    )


def on_files(files: Files, config) -> Files:
    scripts = sorted(EXAMPLES.glob("*.py"))
    jobs = {
        p.stem: ([str(p), "--smoke"], [p])
        for p in scripts
        if p.stem != "edge_of_stability"
    }
    jobs["edge_of_stability"] = (
        [str(EXAMPLES / "edge_of_stability.py"), "--smoke", "--out", "eos.png"],
        [EXAMPLES / "edge_of_stability.py"],
    )
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = {n: pool.submit(_run, n, *job) for n, job in jobs.items()}
        runs = {n: f.result() for n, f in futures.items()}
    # The demo times its steps: it runs alone, not beside another example.
    runs["demo"] = _run(
        "demo", ["-m", "eqfisher._cli", "demo", "--out", "eqfisher-demo.png"], []
    )
    versions = _versions()
    pages = {
        f"examples/{p.stem}.md": _example_page(p, runs[p.stem], versions)
        for p in scripts
    }
    pages["examples/demo.md"] = _demo_page(runs["demo"], versions)
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    for name, run in runs.items():
        for png in sorted(run.glob("*.png")):
            files.append(
                File.generated(
                    config, f"examples/{name}/{png.name}", content=png.read_bytes()
                )
            )
    return files
