"""The maths on the documentation pages is KaTeX, not Unicode.

Formulas are written as `$...$` (inline) and `$$...$$` (display) for
pymdownx.arithmatex and the KaTeX copy served from docs/assets/katex. These tests
read the Markdown sources, the public docstrings that the API reference
(docs/api/*.md) renders, and the module docstrings of the scripts in examples/ that
their pages open with:

- outside code and maths, no character that only a formula uses (⊗, ⁻¹, ᵀ, ‖, Σ,
  √, θ, λ, ...), so no formula is left in plain Unicode;
- every `$` and `$$` is balanced, and placed where arithmatex reads it as maths;
- the Kronecker order inside the maths is the code's, G ⊗ A.
"""

import ast
import inspect
import pathlib
import re

import pytest

from .test_docs import _documented_objects


ROOT = pathlib.Path(__file__).parents[1]
PAGES = (
    "laplace.md",
    "products.md",
    "influence.md",
    "estimators.md",
    "spectral.md",
    "shared_forward.md",
    "scale.md",
    "index.md",
    "getting_started.md",
    "choosing.md",
    "structures.md",
    "losses.md",
    "optim.md",
    "filters.md",
    "layers.md",
    "examples.md",
    "design.md",
    "project.md",
    # The API reference: its pages' own text (the docstrings they render are
    # checked below).
    *(f"api/{p.name}" for p in sorted((ROOT / "docs" / "api").glob("*.md"))),
)
# Characters of formulas, never of prose: operators, super- and subscripts, and the
# Greek letters the pages use as symbols. (×, −, · and → also occur in prose:
# "2–5× faster", "768 → 50,257".)
FORMULA_CHARS = set("⊗⊙⁻₋⁰¹²³ᵀₙᵢⱼₖₗ‖Σ∑∏√∇∂∈≈≤≥½αθλδσμπΔΛφτεκψ")
# Names that contain one of them.
NAMES = ("π-damping", "π-damped")

_FENCE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$", flags=re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1", flags=re.S)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", flags=re.S)
# As arithmatex reads inline maths: no space just inside the dollars.
_INLINE = re.compile(r"(?<![\\$])\$(?![\s$])((?:\\.|[^\\$])+?)(?<!\s)\$(?!\$)")


def _without_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return _INLINE_CODE.sub("`code`", text)


def _page(name: str) -> str:
    return _without_code((ROOT / "docs" / name).read_text())


def _maths(text: str) -> list[str]:
    """The formulas of a page without its code, display ones first."""
    return _DISPLAY.findall(text) + _INLINE.findall(_DISPLAY.sub("", text))


def _prose(text: str) -> str:
    """Everything that is neither code nor maths."""
    text = _INLINE.sub("", _DISPLAY.sub("", text))
    for name in NAMES:
        text = text.replace(name, "")
    return text


@pytest.mark.parametrize("name", PAGES)
def test_no_unicode_formulas(name):
    text = _page(name)
    found = [
        f"line {i}: {line.strip()}"
        for i, line in enumerate(_prose(text).splitlines(), 1)
        if FORMULA_CHARS & set(line)
    ]
    assert not found, f"{name}: formulas in Unicode, write them as $...$:\n" + (
        "\n".join(found)
    )


@pytest.mark.parametrize("name", PAGES)
def test_dollars_are_balanced(name):
    problems = _dollar_problems(name, _page(name))
    assert not problems, "\n".join(problems)


def _dollar_problems(name: str, text: str) -> list[str]:
    """What is wrong with the `$`/`$$` of `text`, Markdown without code; `name`
    says where it comes from."""
    problems = []
    # Display maths is a paragraph of its own: `$$` opens and closes on lines of
    # their own, with a blank line before and after.
    for m in _DISPLAY.finditer(text):
        before, after = text[: m.start()], text[m.end() :]
        if not re.search(r"\n[ \t]*\n[ \t]*$", before):
            problems.append(f"{name}: no blank line before `$$`: {before[-40:]!r}")
        # (or the end of the text: a docstring may end with one)
        if after.strip() and not re.match(r"[ \t]*\n[ \t]*(\n|$)", after):
            problems.append(f"{name}: no blank line after `$$`: {after[:40]!r}")
        if not (m.group(1).startswith("\n") and re.search(r"\n[ \t]*$", m.group(1))):
            problems.append(
                f"{name}: put `$$` on lines of their own: {m.group(0)[:40]!r}"
            )
    rest = _DISPLAY.sub("", text)
    if "$$" in rest:
        problems.append(f"{name}: unbalanced `$$`")
    # Inline maths stays within one paragraph; any `$` left over is unmatched.
    for paragraph in re.split(r"\n[ \t]*\n", rest):
        left = _INLINE.sub("", paragraph.replace(r"\$", ""))
        if "$" in left:
            problems.append(f"{name}: unmatched `$` in:\n{paragraph}")
    return problems


@pytest.mark.parametrize("name", PAGES)
def test_arithmatex_reads_every_formula(name):
    # The page through the Markdown extensions of mkdocs.yml that place maths:
    # every formula found above becomes one arithmatex element (inside lists,
    # tables and admonitions too), and no `$` is left in the text.
    problems = _arithmatex_problems(name, (ROOT / "docs" / name).read_text())
    assert not problems, "\n".join(problems)


def _arithmatex_problems(name: str, source: str) -> list[str]:
    """Where arithmatex reads `source` (Markdown with its code) differently from
    `_maths`; `name` says where it comes from."""
    import markdown  # the test extra installs markdown and pymdown-extensions

    # Code blocks (some run by markdown-exec at build time) become a placeholder.
    source = _FENCE.sub(r"\1code", source)
    html = markdown.markdown(
        source,
        extensions=["admonition", "md_in_html", "tables", "pymdownx.arithmatex"],
        extension_configs={"pymdownx.arithmatex": {"generic": True}},
    )
    html = re.sub(r"<code>.*?</code>", "", html, flags=re.S)
    problems = []
    found = len(re.findall(r'<(span|div) class="arithmatex">', html))
    expected = len(_maths(_without_code(source)))
    if found != expected:
        problems.append(f"{name}: arithmatex read {found} formulas, not {expected}")
    text = re.sub(r'<(span|div) class="arithmatex">.*?</\1>', "", html, flags=re.S)
    if "$" in text:
        problems.append(f"{name}: a `$` arithmatex did not read as maths")
    return problems


@pytest.mark.parametrize("name", PAGES)
def test_maths_kronecker_order(name):
    # test_docs.py checks the literal "A \otimes G"; this catches the same order
    # with factors' eigenbases, inverses and damping (Q_A \otimes Q_G, ...).
    problems = _kronecker_problems(name, _page(name))
    assert not problems, "\n".join(problems)


def _kronecker_problems(name: str, text: str) -> list[str]:
    bad = re.compile(r"A\b[^\\]*?\\otimes\s*\(?\s*(?:[QS]_)?G\b")
    return [
        f"{name}: {term!r}; write G \\otimes A"
        for formula in _maths(text)
        for term in re.split(r"[=,;]|\\q?quad", formula)
        if bad.search(term)
    ]


def test_the_checks_see_formulas():
    # The helpers find maths and Unicode formulas where they are.
    text = "A $G \\otimes A$ block.\n\n$$\nx^\\top y\n$$\n\n`θ` in code, θ⁻¹ not"
    assert _maths(text) == ["\nx^\\top y\n", "G \\otimes A"]
    assert FORMULA_CHARS & set(_prose(_without_code(text))) == {"θ", "⁻", "¹"}
    assert not _INLINE.search("costs $ 5 and $ 6")
    # ... and the problems where they are.
    assert not _dollar_problems("ok", text)
    assert _dollar_problems("x", "one $a$ and $ left") == [
        "x: unmatched `$` in:\none $a$ and $ left"
    ]
    assert "no blank line before" in _dollar_problems("x", "text\n$$\na\n$$\n")[0]
    assert _kronecker_problems("x", "$A \\otimes G$") == [
        "x: 'A \\\\otimes G'; write G \\otimes A"
    ]
    assert not _kronecker_problems("x", "$G \\otimes A$")
    assert not _arithmatex_problems("ok", text)
    assert _arithmatex_problems("x", "a `$b$` and $c") == [
        "x: a `$` arithmatex did not read as maths"
    ]


# --- docstrings ---------------------------------------------------------------------
#
# The API reference (docs/api/*.md) renders the public docstrings (mkdocstrings,
# with the same arithmatex), and each example's page opens with its script's module
# docstring (docs/hooks/examples.py), so their formulas are KaTeX too: in prose, not
# in ```python examples or `code`.

# Source files whose docstrings still have Unicode formulas, relative to the
# repository root. Empty it as they are converted, and keep it empty.
UNICODE_DOCSTRINGS: frozenset[str] = frozenset()


def _source(obj) -> str:
    """The file that defines `obj`, relative to the repository root."""
    obj = obj.fget if isinstance(obj, property) else obj
    obj = inspect.unwrap(obj)  # functools.wraps, singledispatch, eqx.filter_jit
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:  # a callable instance
        path = inspect.getsourcefile(type(obj))
    path = pathlib.Path(path).resolve()
    # A dependency installed outside the checkout (a user's own environment) keeps
    # its absolute path.
    return (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix()


def _doc_owner(obj):
    """Where `inspect.getdoc(obj)` takes the docstring from: a method without one
    inherits it from the first base class that has one."""
    fn = obj.fget if isinstance(obj, property) else obj
    if getattr(fn, "__doc__", None) or "." not in getattr(fn, "__qualname__", ""):
        return obj
    owner, name = fn.__qualname__.rsplit(".", 1)
    cls = getattr(inspect.getmodule(fn), owner, None)
    for base in getattr(cls, "__mro__", ())[1:]:
        attr = vars(base).get(name)
        if attr is not None and getattr(attr, "__doc__", None):
            return attr
    return obj


def _docstrings() -> list[tuple[str, str, str]]:
    """(qualified name, file that holds its docstring, docstring) of every public
    object."""
    out = []
    for qual, obj in _documented_objects():
        doc = inspect.getdoc(obj)
        if doc:
            out.append((qual, _source(_doc_owner(obj)), doc))
        # The API reference merges a class's `__init__` docstring into its entry.
        init = vars(obj).get("__init__") if inspect.isclass(obj) else None
        if init is not None and init.__doc__:
            out.append(
                (f"{qual}.__init__", _source(obj), inspect.cleandoc(init.__doc__))
            )
    return out


def _example_docstrings() -> list[tuple[str, str, str]]:
    """(file, file, module docstring) of every script in examples/: the hook
    docs/hooks/examples.py makes each one's page from it. Read from the source, as
    the hook does, without importing the script."""
    out = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            name = path.relative_to(ROOT).as_posix()
            out.append((name, name, doc))
    return out


DOCSTRINGS = _docstrings() + _example_docstrings()


def _unicode_formulas(doc: str) -> list[str]:
    return [
        line.strip()
        for line in _prose(_without_code(doc)).splitlines()
        if FORMULA_CHARS & set(line)
    ]


def test_docstrings_have_no_unicode_formulas():
    found = [
        f"{qual} ({path}): {line}"
        for qual, path, doc in DOCSTRINGS
        if path not in UNICODE_DOCSTRINGS
        for line in _unicode_formulas(doc)
    ]
    assert not found, "formulas in Unicode, write them as $...$:\n" + "\n".join(found)


def test_docstring_allowlist_is_current():
    # A file leaves UNICODE_DOCSTRINGS once its docstrings are converted.
    paths = {path for _, path, _ in DOCSTRINGS}
    assert UNICODE_DOCSTRINGS <= paths, UNICODE_DOCSTRINGS - paths
    left = {path for _, path, doc in DOCSTRINGS if _unicode_formulas(doc)}
    assert UNICODE_DOCSTRINGS <= left, (
        f"no Unicode formula left, remove from UNICODE_DOCSTRINGS: "
        f"{sorted(UNICODE_DOCSTRINGS - left)}"
    )


def test_docstring_dollars_are_balanced():
    problems = [
        p
        for qual, _, doc in DOCSTRINGS
        for p in _dollar_problems(qual, _without_code(doc))
    ]
    assert not problems, "\n".join(problems)


def test_arithmatex_reads_every_docstring_formula():
    problems = [
        p for qual, _, doc in DOCSTRINGS for p in _arithmatex_problems(qual, doc)
    ]
    assert not problems, "\n".join(problems)


def test_docstring_maths_kronecker_order():
    problems = [
        p
        for qual, _, doc in DOCSTRINGS
        for p in _kronecker_problems(qual, _without_code(doc))
    ]
    assert not problems, "\n".join(problems)


def test_docstrings_with_maths_are_raw():
    # In a plain string `\nabla`, `\top` and `\bar` hold a newline, a tab and a
    # backspace: a docstring with maths and backslashes is `r"""..."""`.
    found = []
    paths = sorted((ROOT / "eqfisher").rglob("*.py"))
    for path in [*paths, *sorted((ROOT / "examples").glob("*.py"))]:
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if not isinstance(body, list) or not body:
                continue
            first = body[0]
            if not (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                continue
            literal = ast.get_source_segment(source, first.value) or ""
            if "$" in literal and "\\" in literal and literal[0] not in "rR":
                found.append(f"{path.relative_to(ROOT)}:{first.lineno}")
    assert not found, f'write these docstrings as r"""...""": {found}'


def test_the_docstring_checks_see_formulas():
    # The docstrings are found, with their files, and the maths in them is read.
    assert len(DOCSTRINGS) > 100
    paths = {path for _, path, _ in DOCSTRINGS}
    assert {"eqfisher/losses/_family.py", "eqfisher/blocks/kronecker.py"} <= paths
    maths = [f for _, _, doc in DOCSTRINGS for f in _maths(_without_code(doc))]
    assert r"S S^\top = H" in maths
    # Every example script's module docstring, which its page opens with.
    scripts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.py")}
    assert scripts and scripts <= paths
    assert "\n" + r"\Lambda = N C + \delta I," + "\n" in maths  # laplace_digits.py
    # Code in a docstring is not prose: an example's comment may use Unicode.
    doc = "A $\\lambda$ step.\n\n```python\nx = 1  # (B + λI)⁻¹ v\n```\n"
    assert not _unicode_formulas(doc) and _unicode_formulas("(B + λI)⁻¹ v")


def test_sources_outside_the_checkout_keep_their_path(tmp_path):
    # The suite runs from an environment outside the checkout too: a dependency's
    # docstring is then read from an absolute path (this raised at collection).
    import importlib.util

    file = tmp_path / "outside.py"
    file.write_text('def f():\n    """A docstring."""\n')
    spec = importlib.util.spec_from_file_location("outside", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert _source(module.f) == file.resolve().as_posix()
    assert _source(_source) == "tests/test_docs_maths.py"
