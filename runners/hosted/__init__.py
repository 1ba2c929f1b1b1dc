"""Judging on the target: entry points shipped to the host with the analysis modules they use.

Each module here imports only the standard library, numpy, analysis/ and runners/atomic.py
(what runners.kind.HostJudging ships), runs through runners/hosted/boot.py (isolated, from
checked bytes) and prints one JSON line, its answer, on stdout; it writes nothing there.
"""
