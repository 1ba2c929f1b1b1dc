"""numpy loaded with its OpenBLAS on one thread, in the `tracedeck` program.

At load, OpenBLAS starts a pool of threads that spin for ~0.1 s of CPU waiting for work, beside
whatever the program starts with (the first screen, a pair being judged); tracedeck multiplies
no matrices. The variable is taken back once numpy is loaded: the engines and commands that
tracedeck starts get the environment it was given.
"""

from __future__ import annotations

import os
import sys

_VARIABLE = "OPENBLAS_NUM_THREADS"


def load_numpy() -> None:
    """Import numpy with OpenBLAS on one thread, unless it is loaded or the variable is set."""
    if "numpy" in sys.modules or _VARIABLE in os.environ:
        return
    os.environ[_VARIABLE] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ[_VARIABLE]
