"""Reference torch engine for the tracedeck seed workflows (B3.67, B3.11/B3.12, ...).

Shipped to GPU hosts as plain files: it imports only the standard library, torch, numpy,
(optionally) orjson, and the stdlib-only runners modules named in SHIPPED_WITH, never the rest
of tracedeck. Run it as ``python -m runners.reference COMMAND``; each command is a module here
that defines ``add_arguments(parser)`` and ``run(args)``.
"""

# Modules of the runners package (paths relative to it) shipped beside this one.
SHIPPED_WITH = ("__init__.py", "atomic.py")
