"""MkDocs hook: one page per example script, with the output of a real run.

At every build each script in `examples/` is run (`--smoke`: small data, few steps,
so the whole set takes about two minutes on two cores), and its page is generated
from the script's module docstring (its single source: the docstring writes its
formulas as KaTeX, `$...$` and `$$` blocks, which the page renders), the notes on
the full run in `notes/NAME.md` where there are any, its printed output, the plots
it wrote and its full source: what the site shows cannot drift from what the code
does. `eqfisher demo` runs too (its full run: a few seconds of training), for
its table and PNG.

Results are cached in the checkout, under `.cache/docs/NAME/KEY/` (git-ignored),
where KEY hashes the script's own source, its arguments, the package's sources,
`pyproject.toml` and the Python executable: a rebuild after a docs-only change runs
nothing, and any change to `eqfisher/` reruns every example. A script that fails
fails the build.

The pages' executed code blocks (markdown-exec's `exec="on"`: Getting started,
the home page) run at every build too, and their HTML is cached in
`.cache/docs/exec/` for fast mode (below).

Fast mode, for writing the docs (`EQFISHER_DOCS_FAST=1 mkdocs serve`): no example
and no code block runs. Each page shows the newest cached output of its script
(or block), saying on the page when it is older than the current script or
package; one with no cached output gets its page without output, under a note
"Output not run in fast mode". The build never fails for an example in fast mode,
and it logs how many are stale or not run (at INFO level when the build is
strict, as `mkdocs.yml` makes it, since a strict build fails on any warning; as a
warning with `--no-strict`).
"""

import concurrent.futures
import datetime
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
from typing import NamedTuple

from mkdocs.structure.files import File, Files


log = logging.getLogger("mkdocs.hooks.examples")
ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
CACHE = ROOT / ".cache" / "docs"
# Set (to anything but "" or "0") for a fast build: cached output only, nothing runs.
FAST_ENV = "EQFISHER_DOCS_FAST"
# Cached runs kept per example (the newest ones), for fast mode's stale pages.
KEEP = 3
# Two workers: CI and the developers' machines have two cores.
WORKERS = 2
TIMEOUT_S = 900


class Run(NamedTuple):
    """The output an example's page shows.

    `folder`: the cached run (`stdout.txt`, `versions.txt`, the PNGs), or None
    where fast mode found none; `stale`: the run is of an older script or package
    (fast mode only).
    """

    folder: pathlib.Path | None
    stale: bool = False


def _fast() -> bool:
    return os.environ.get(FAST_ENV, "") not in ("", "0")


def _package_hash() -> str:
    """A hash of the package's sources, `pyproject.toml` and the Python executable."""
    h = hashlib.sha256(sys.executable.encode())
    files = sorted((ROOT / "eqfisher").rglob("*.py")) + [ROOT / "pyproject.toml"]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _key(argv: list[str], extra: list[pathlib.Path]) -> str:
    """The cache key of one run: its own sources (`extra`: the script) and
    arguments, and the package (`_package_hash`)."""
    h = hashlib.sha256(_package_hash().encode())
    h.update("\0".join(argv).replace(str(ROOT), ".").encode())
    for f in extra:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _cached(name: str) -> list[pathlib.Path]:
    """The complete cached runs of `name`, newest first."""
    runs = [p for p in (CACHE / name).glob("*") if (p / "ok").exists()]
    return sorted(runs, key=lambda p: (p / "ok").stat().st_mtime, reverse=True)


def _run(name: str, argv: list[str], extra: list[pathlib.Path]) -> Run:
    """Runs `argv` in a fresh folder, unless cached; returns the run's folder
    (stdout.txt, versions.txt and the files it wrote). In fast mode nothing runs:
    the newest cached run, if any."""
    out = CACHE / name / _key(argv, extra)
    if (out / "ok").exists():
        return Run(out)
    if _fast():
        cached = _cached(name)
        return Run(cached[0], stale=True) if cached else Run(None)
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
    (tmp / "versions.txt").write_text(_versions())
    (tmp / "ok").write_text(datetime.datetime.now().isoformat(timespec="minutes"))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(tmp, out)
    for old in _cached(name)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    return Run(out)


def _versions() -> str:
    import jax  # noqa: PLC0415

    return (
        f"eqfisher {importlib.metadata.version('eqfisher')}, jax {jax.__version__}, "
        f"Python {platform.python_version()}, {jax.default_backend().upper()}"
    )


def _run_versions(run: Run) -> str:
    f = run.folder / "versions.txt"
    return f.read_text().strip() if f.exists() else _versions()


def _fast_note(run: Run, command: str) -> list[str]:
    """The admonition of a page whose output is stale or was not run (fast mode)."""
    if run.folder is None:
        return [
            '!!! warning "Output not run in fast mode"',
            f"    This site was built with `{FAST_ENV}=1`, which runs no example, "
            f"and no cached output of `{command}` was found: a build without "
            f"`{FAST_ENV}` runs it and shows its output here.",
            "",
        ]
    if run.stale:
        when = (run.folder / "ok").read_text().strip() or "an earlier build"
        return [
            '!!! warning "Cached output of an older version (fast mode)"',
            f"    This site was built with `{FAST_ENV}=1`: the output below is the "
            f"newest cached run of `{command}` ({when}), made before the latest "
            "changes to the script or the package, so it may not be what the "
            f"code now prints. A build without `{FAST_ENV}` reruns it.",
            "",
        ]
    return []


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


def _example_page(path: pathlib.Path, run: Run) -> str:
    title, body = _docstring(path)
    name = path.stem
    body = _intro(body)
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
    lines += ["## Output of the small run", ""]
    lines += _fast_note(run, f"python examples/{name}.py --smoke")
    if run.folder is not None:
        lines += [
            '!!! note "What this output is"',
            f"    The printed output of `python examples/{name}.py --smoke`, run "
            f"for this site ({_run_versions(run)}). The smoke run uses smaller "
            "data, a smaller model and fewer steps than the full run, so its "
            "numbers are not the full run's. The test suite runs the same smoke "
            "mode and checks its results (`tests/test_examples.py`).",
            "",
            "```text",
            (run.folder / "stdout.txt").read_text().rstrip() or "(no output)",
            "```",
            "",
        ]
        for png in sorted(p.name for p in run.folder.glob("*.png")):
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


def _demo_page(run: Run) -> str:
    lines = [
        "# The demo: K-FAC against Adam and Muon",
        "",
        "`eqfisher demo` trains the same MLP (10-64-64-1, tanh) on "
        "scikit-learn's diabetes regression data (inputs and target standardised) "
        "with K-FAC (`ef.optim.kfac_step`, Monte-Carlo Fisher, every option but "
        "the learning rate at its default), with Adam and with Muon "
        "(`optax.contrib.muon`), each at the best learning rate of its grid "
        "(`benchmarks/kfac_defaults.py`), and reports the steps and the "
        "steady-state seconds each needs to reach a training loss of 0.15, with "
        "the first call's compile time in a column of its own. K-FAC takes about "
        "an eighth of Adam's steps and a sixth of Muon's, and a sixth to a half "
        "of their seconds; its step compiles two to three times as long as Adam's "
        "and about as long as Muon's (jax 0.10 on the CPU), which on a run "
        'this short is more than the training (`benchmarks/RESULTS.md`, "Issue 26, '
        'tenth session" and "twenty-first session"). '
        "All three overfit this small training set (331 examples) by the end of "
        "the run: the test loss is the last column. It is the README's first "
        "command:",
        "",
        "```bash",
        'pip install -e ".[demo]" && eqfisher demo',
        "```",
        "",
        "## Output",
        "",
    ]
    lines += _fast_note(run, "eqfisher demo")
    if run.folder is not None:
        lines += [
            '!!! note "What this output is"',
            "    The full run of `eqfisher demo` (100 steps per optimiser), run for "
            f"this site ({_run_versions(run)}). Seconds depend on the machine "
            "and on its load when the site was built; the steps do not.",
            "",
            "```text",
            (run.folder / "stdout.txt").read_text().rstrip(),
            "```",
            "",
            "![Training loss of K-FAC, Adam and Muon against steps and seconds]"
            "(demo/eqfisher-demo.png)",
            "",
        ]
    lines += [
        '??? example "The code: `eqfisher/_demo.py`"',
        "",
        '    ```python title="eqfisher/_demo.py"',
        textwrap.indent((ROOT / "eqfisher" / "_demo.py").read_text().rstrip(), "    "),
        "    ```",
        "",
    ]
    return "\n".join(lines)


# --- the pages' executed code blocks (markdown-exec), cached for fast mode ---
#
# markdown-exec runs the `exec="on"` Python blocks of the pages (Getting started,
# the home page's quickstart) at every build: about 40 s on two cores. A normal
# build runs them all, as before, and keeps each block's HTML in
# `.cache/docs/exec/`, keyed by the block's code and options and by every earlier
# block of its session (a block's output depends on them). A fast build runs none:
# it shows the cached HTML (with a note where the package changed since) or, for a
# block not in the cache, its source under an "output not run in fast mode" note.

EXEC_CACHE = CACHE / "exec"
_exec = {"chain": {}, "stale": 0, "not_run": 0, "package": ""}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _converted(md, text: str) -> str:
    from markdown_exec import MarkdownConverter  # noqa: PLC0415

    return MarkdownConverter(md, update_toc=False).convert(text)


def _format_python(original, *, code: str, md, **options) -> str:
    session = options.get("session") or ""
    h = hashlib.sha256(_exec["chain"].get(session, "").encode())
    h.update(repr(sorted(options.items(), key=str)).encode())
    h.update(code.encode())
    key = h.hexdigest()[:20]
    if session:
        _exec["chain"][session] = key
    html, meta = EXEC_CACHE / f"{key}.html", EXEC_CACHE / f"{key}.txt"
    if not _fast():
        warnings = _Warnings()
        logging.getLogger("mkdocs").addHandler(warnings)
        try:
            out = original(code=code, md=md, **options)
        finally:
            logging.getLogger("mkdocs").removeHandler(warnings)
        if not warnings.count:  # markdown-exec logs a warning where a block fails
            EXEC_CACHE.mkdir(parents=True, exist_ok=True)
            html.write_text(str(out))
            now = datetime.datetime.now().isoformat(timespec="minutes")
            meta.write_text(f"{_exec['package']}\n{now}\n")
        return out
    from markupsafe import Markup  # noqa: PLC0415

    if html.exists() and meta.exists():
        package, when = (meta.read_text().split("\n") + [""])[:2]
        if package == _exec["package"]:
            return Markup(html.read_text())  # noqa: S704
        _exec["stale"] += 1
        note = _converted(
            md,
            '!!! warning "Cached output of an older version (fast mode)"\n'
            f"    The output below was cached at {when}, before the latest changes "
            f"to the package. A build without `{FAST_ENV}` reruns it.\n",
        )
        # `str`: a Markup would escape the cached HTML it is added to.
        return Markup(str(note) + html.read_text())  # noqa: S704
    _exec["not_run"] += 1
    return _converted(
        md,
        '!!! warning "Output not run in fast mode"\n'
        f"    This site was built with `{FAST_ENV}=1`, which runs no code, and this "
        f"block's output is not in the cache: a build without `{FAST_ENV}` runs it."
        f"\n\n```python\n{code}\n```\n",
    )


def on_config(config):
    """Wraps markdown-exec's Python formatter with `_format_python` (once: the
    hook module is loaded again at each rebuild of `mkdocs serve`)."""
    try:
        import markdown_exec  # noqa: PLC0415
    except ImportError:
        return config
    _exec.update(chain={}, stale=0, not_run=0, package=_package_hash())
    current = markdown_exec.formatters["python"]
    original = getattr(current, "eqfisher_original", current)

    def formatter(**kwargs):
        return _format_python(original, **kwargs)

    formatter.eqfisher_original = original
    markdown_exec.formatters["python"] = formatter
    return config


def on_post_build(config) -> None:
    if _fast() and (_exec["stale"] or _exec["not_run"]):
        (log.info if config.strict else log.warning)(
            "%s: %d executed code blocks of the pages show stale cached output and "
            "%d were not run; a build without %s runs them",
            FAST_ENV,
            _exec["stale"],
            _exec["not_run"],
            FAST_ENV,
        )


def _report_fast(runs: dict[str, Run], strict: bool) -> None:
    """Fast mode: logs which pages show stale output and which none."""
    stale = sorted(n for n, r in runs.items() if r.stale)
    not_run = sorted(n for n, r in runs.items() if r.folder is None)
    if not stale and not not_run:
        log.info("%s: every example page shows up-to-date cached output", FAST_ENV)
        return
    # A strict build (mkdocs.yml sets `strict: true`) fails on any warning, and
    # fast mode must not fail: INFO there, a warning with `--no-strict`.
    (log.info if strict else log.warning)(
        "%s: %d of %d example pages show stale cached output (%s) and %d were not "
        "run (%s); a build without %s runs them",
        FAST_ENV,
        len(stale),
        len(runs),
        ", ".join(stale) or "none",
        len(not_run),
        ", ".join(not_run) or "none",
        FAST_ENV,
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
    if _fast():
        _report_fast(runs, bool(config.strict))
    pages = {f"examples/{p.stem}.md": _example_page(p, runs[p.stem]) for p in scripts}
    pages["examples/demo.md"] = _demo_page(runs["demo"])
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    for name, run in runs.items():
        if run.folder is None:
            continue
        for png in sorted(run.folder.glob("*.png")):
            files.append(
                File.generated(
                    config, f"examples/{name}/{png.name}", content=png.read_bytes()
                )
            )
    return files
