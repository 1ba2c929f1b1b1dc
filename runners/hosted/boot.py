"""The one way a shipped judge runs on the target: from bytes checked against the console's hashes.

    python -I -S -c "$(this file's text)" JUDGE_DIR MANIFEST ENTRY [ARGS...]
    python -I -S -c "$(this file's text)" --imports MODULE...   (can this python judge?)

The console sends this program's text on the command line (it is never read from the target)
and MANIFEST, a JSON object mapping each shipped file (relative to JUDGE_DIR) to the sha256 of
the console's own copy. `-I` keeps the current directory (the engine's output), PYTHON*
variables and the user's site-packages off the path; `-S` keeps `site` from running anything
in the interpreter's site-packages (a sitecustomize, a .pth line: the engine's user may be able
to write a venv), which are then put on the path as `site` would, as plain directories. Every
shipped file is read once and checked before any of it runs; the modules are then made from
those checked bytes (the files, which the engine's process can write, are never read again),
and a module of the shipped packages that the manifest does not hold is refused rather than
looked for elsewhere.
ENTRY's main(ARGS) then runs. A file that differs prints {"ok": false, "tampered": WHY} and
exits 3. Standard library only: nothing is imported from the target before the check.
"""

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import site
import stat
import sys

TAMPERED_EXIT = 3
ISOLATED = ("-I", "-S")  # how every judging python starts


class CheckedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the shipped packages from checked bytes, and only from them."""

    def __init__(self, sources, packages):
        self.sources = sources  # module name -> (path, bytes, is a package)
        self.packages = packages  # top-level names no other finder may serve

    def find_spec(self, name, path=None, target=None):
        if name not in self.sources:
            if name.split(".")[0] in self.packages:
                raise ImportError(f"{name} was not shipped with the judge (refused)", name=name)
            return None
        origin, _, package = self.sources[name]
        spec = importlib.machinery.ModuleSpec(name, self, origin=origin, is_package=package)
        spec.has_location = True  # __file__ = the checked file's path
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        origin, data, _ = self.sources[module.__spec__.name]
        exec(compile(data, origin, "exec", dont_inherit=True), module.__dict__)


def checked_sources(root, manifest):
    """{module: (path, bytes, is a package)}; raises ValueError naming a file that differs."""
    sources = {}
    for rel, digest in manifest.items():
        path = f"{root}/{rel}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait forever
            with open(fd, "rb", closefd=True) as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{path}: not a regular file; nothing of the judge was run")
                os.set_blocking(fd, True)
                data = fh.read()
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise ValueError(
                f"{path}: sha256 {got[:16]}..., but the console shipped {digest[:16]}...: the "
                "judge was changed after it was shipped; nothing of it was run"
            )
        package = rel.endswith("/__init__.py")
        name = rel[: -len("/__init__.py")] if package else rel[: -len(".py")]
        sources[name.replace("/", ".")] = (path, data, package)
    return sources


def site_packages():
    """The interpreter's site-packages on sys.path, as `site` finds them (a venv's own, and its
    base's when pyvenv.cfg includes them), with nothing in them run."""
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    prefixes = [sys.prefix]
    for conf in (
        os.path.join(exe_dir, "pyvenv.cfg"),
        os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg"),
    ):
        if os.path.isfile(conf):
            cfg = {}
            with open(conf, encoding="utf-8") as fh:
                for line in fh:
                    key, _, value = line.partition("=")
                    cfg[key.strip().lower()] = value.strip().lower()
            venv = os.path.dirname(conf)
            both = cfg.get("include-system-site-packages") == "true"
            prefixes = [venv, sys.prefix] if both else [venv]
            break
    for path in site.getsitepackages(prefixes):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)


def main():
    # Before numpy loads: its OpenBLAS would start a thread that spins for ~0.1 s of CPU at
    # import, waiting for work; no judge multiplies matrices.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    site_packages()
    if sys.argv[1] == "--imports":  # plan --check: can this python import what judging needs?
        for name in sys.argv[2:]:  # and can the login user (the engine's) change what it found?
            found = os.path.dirname(importlib.import_module(name).__file__ or ".")
            print(json.dumps({"module": name, "dir": found, "writable": os.access(found, os.W_OK)}))
        return 0
    root, manifest, entry, args = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]
    try:
        sources = checked_sources(root, manifest)
    except ValueError as exc:
        print(json.dumps({"ok": False, "tampered": str(exc)}))
        return TAMPERED_EXIT
    sys.meta_path.insert(0, CheckedModules(sources, {n.split(".")[0] for n in sources}))
    if "analysis.parallel" in sources:
        # The helper process that reads a pair's second side runs the same way: this program,
        # these hashes (never `python -c` with the engine's directory first on its path).
        code = sys.orig_argv[sys.orig_argv.index("-c") + 1]
        parallel = importlib.import_module("analysis.parallel")
        parallel.HELPER_COMMAND = [sys.executable, *ISOLATED, "-c", code, root, sys.argv[2]]
    return importlib.import_module(entry).main(args)


if __name__ == "__main__":
    sys.exit(main())
