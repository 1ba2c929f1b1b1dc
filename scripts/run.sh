#!/usr/bin/env bash
# Installs what is missing, then opens the tracedeck console (local target by default).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/scripts/install.sh"
exec "$here/.venv/bin/tracedeck" "$@"
