"""asyncssh, imported without the warnings its DSA support raises at import.

cryptography deprecates DSA, and asyncssh's import touches it: five CryptographyDeprecationWarning
lines (about key types tracedeck never makes) printed on stderr ahead of what every SSH command
said. Only those, and only during the import: anything warned later is shown as usual.
"""

from __future__ import annotations

import warnings

from cryptography.utils import CryptographyDeprecationWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", CryptographyDeprecationWarning)
    import asyncssh
    import asyncssh.public_key

__all__ = ["asyncssh"]
