"""`python -m eqfisher`: the `eqfisher` command line."""

import sys

from ._cli import main


sys.exit(main())
