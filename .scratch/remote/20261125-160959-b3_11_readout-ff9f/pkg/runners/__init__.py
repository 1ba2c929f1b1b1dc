"""Execution: presets, targets, launchers, followers, run kinds and the reference engine."""

import pkgutil

# Kind plug-ins may live in another directory that has runners/kinds/ (see runners.kinds).
__path__ = pkgutil.extend_path(__path__, __name__)
