"""The `eqfisher` command line."""

import argparse
import importlib.metadata
import io
import pathlib
import sys


def _seed(text: str) -> int:
    """A seed for NumPy and scikit-learn: an int in [0, 2**32 - 1]."""
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1], got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _unwritable(out: pathlib.Path) -> str | None:
    """Why the plot cannot be written to `out` (checked before training), or
    `None`: a folder, a parent that is not a folder, no write permission, or a
    format whose writer fails (PGF without LaTeX)."""
    from matplotlib.figure import Figure

    if out.is_dir():
        return "it is a folder; name a file in it"
    formats = Figure().canvas.get_supported_filetypes()
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        return (
            f"matplotlib writes no {out.suffix or 'extensionless'} file; end it in "
            f"one of {', '.join('.' + f for f in sorted(formats))}"
        )
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"{parent} is not a folder"
    try:
        # With text, as the plot has: an empty figure wrote PGF without LaTeX,
        # and the real plot failed after the training.
        figure = Figure()
        figure.text(0.5, 0.5, "eqfisher")
        figure.savefig(io.BytesIO(), format=suffix)
    except Exception as e:  # e.g. PGF needs LaTeX
        return f"matplotlib cannot write {out.suffix} here ({e})"
    existed = out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("ab"):
            pass
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    if not existed:
        out.unlink()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eqfisher", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {importlib.metadata.version('eqfisher')}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="K-FAC against Adam and Muon on scikit-learn's diabetes regression "
        "data: steps and seconds to a target loss, compile apart, and a loss plot",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--steps", type=_positive, default=100, help="training steps per optimiser"
    )
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("eqfisher-demo.png"),
        help="where to write the loss plot (PNG; any format matplotlib writes, by "
        "the file's extension)",
    )
    demo.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of the train/test split and the models' initialisation",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            import matplotlib  # noqa: F401

            from ._demo import run_demo
        except ImportError as e:  # the demo extras are missing
            print(
                f"eqfisher demo needs the demo extras: pip install 'eqfisher[demo]' "
                f"({e})",
                file=sys.stderr,
            )
            return 1
        why = _unwritable(args.out)
        if why is not None:
            demo.error(f"--out {args.out}: {why}")
        run_demo(args.steps, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
