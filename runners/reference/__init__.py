"""Reference torch engine for the tracedeck seed workflows (B3.67, B3.11/B3.12).

Shipped to GPU hosts as plain files: it imports only the standard library, torch, numpy and
(optionally) orjson, never the rest of tracedeck. Run it as ``python -m runners.reference``.
"""
