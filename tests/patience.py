"""How long a test waits before it gives up: the timeouts are safety nets, never the thing tested,
so on a machine busier than it has cores (CI beside other jobs) they stretch with the load."""

from __future__ import annotations

import os

MOST = 8.0  # a wait never stretches beyond 8 times its written timeout


def patience(seconds: float) -> float:
    """seconds, times how oversubscribed the machine is now (1-minute load per core, 1 at least,
    at most MOST); TRACEDECK_TEST_PATIENCE=F fixes the factor instead."""
    fixed = os.environ.get("TRACEDECK_TEST_PATIENCE")
    if fixed:
        return seconds * float(fixed)
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return seconds * min(MOST, max(1.0, load))
