"""The `eqfisher` command line."""

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eqfisher", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="K-FAC against Adam and Muon on scikit-learn's diabetes regression "
        "data: steps and seconds to a target loss, compile apart, and a loss plot",
    )
    demo.add_argument(
        "--steps", type=int, default=100, help="training steps per optimiser"
    )
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("eqfisher-demo.png"),
        help="where to write the loss plot (PNG; any format matplotlib writes, by "
        "the file's extension)",
    )
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1:
            demo.error("--steps must be positive")
        try:
            from matplotlib.figure import Figure

            from ._demo import run_demo
        except ImportError as e:  # the demo extras are missing
            print(
                f"eqfisher demo needs the demo extras: pip install 'eqfisher[demo]' ({e})"
            )
            return 1
        formats = Figure().canvas.get_supported_filetypes()
        if args.out.suffix.lstrip(".").lower() not in formats:
            demo.error(
                f"--out {args.out}: matplotlib writes no {args.out.suffix or 'extensionless'}"
                f" file; end it in one of {', '.join('.' + f for f in sorted(formats))}"
            )
        run_demo(args.steps, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
