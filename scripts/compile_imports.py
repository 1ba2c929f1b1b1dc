"""Cache the bytecode of what tracedeck and its tests import, by importing it.

scripts/install.sh runs it once after pip (which installs with --no-compile): pip's own pass
compiled every installed file, torch's whole tree included (~20 s of CPU, mostly modules
nothing here imports), one file at a time. Importing compiles and caches exactly what is used;
anything else is compiled when first imported. Run with PYTHONDONTWRITEBYTECODE unset.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the test tools the suite loads (pytest's plugins, what the tests read results back with)
TOOLS = (
    "pytest",
    "xdist",
    "pytest_asyncio",
    "pytest_textual_snapshot",
    "duckdb",
    "xmlschema",
    "importlinter",
    "pyarrow.parquet",
)
SCRIPTS = ("runners.changes",)  # modules that run when imported


def main() -> int:
    if sys.dont_write_bytecode:
        print("compile_imports: PYTHONDONTWRITEBYTECODE is set: nothing would be cached")
        return 2
    sys.path.insert(0, str(ROOT))
    warnings.simplefilter("ignore")  # what the imports warn of is said where they are used
    names = list(TOOLS)
    for package in ("console", "runners", "analysis"):
        pkg = importlib.import_module(package)
        names += [
            info.name
            for info in pkgutil.walk_packages(pkg.__path__, package + ".")
            if info.name not in SCRIPTS and not info.name.endswith("__main__")
        ]
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a cache, not a check: it compiles when first imported
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    if failed:
        print("compile_imports: not imported here, compiled when first used: " + "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
