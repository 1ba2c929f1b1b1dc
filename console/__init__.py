"""The Textual console, its screens, widgets and kind panels, and the CLI."""

import pkgutil

# Kind panels may live in another directory that has console/panels/ (see console.panels).
__path__ = pkgutil.extend_path(__path__, __name__)
