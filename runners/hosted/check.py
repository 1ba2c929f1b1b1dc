"""Can this host judge? Imports each module named (run through runners/hosted/boot.py).

    python -I -c BOOT JUDGE_DIR MANIFEST runners.hosted.check numpy runners.hosted.equivalence

Exit 0 when every one imports; else prints why (the module and the error) and exits 1.
"""

from __future__ import annotations

import importlib


def main(argv: list[str]) -> int:
    for name in argv:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure to import is the answer, not a crash
            print(f"{name}: {type(exc).__name__}: {exc}")
            return 1
    return 0
