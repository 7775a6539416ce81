#!/usr/bin/env bash
# Runs the kvshare demo in .venv/ (created and filled on first use) on its embedded defaults.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
exec "$py" -m services.cli demo "$@"
