"""The repository's root off `sys.path` for the tests: `python -m pytest` puts the working folder first, where our
`kernels/` folder would shadow the `kernels` package transformers (5.x) imports. lanefuse itself is imported as the
installed `lanefuse.*`, never through the root."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
