#!/usr/bin/env bash
# Creates .venv/ in the repository root (once) and installs kvshare with its test and local extras into it
# (again whenever pyproject.toml changes). Sourced by the other scripts; prints the venv's python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"

find_python() {
  for candidate in "${KVSHARE_PYTHON:-}" python3.11 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      echo "$candidate"; return 0
    fi
  done
  echo "kvshare needs Python 3.11 (python3.11 or python3 on PATH, or KVSHARE_PYTHON)" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  if ! "$py" -m venv "$venv" >&2; then
    echo "could not create $venv: on Debian/Ubuntu run 'apt-get install python3.11-venv' first" >&2
    exit 1
  fi
fi

stamp="$venv/.kvshare-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[test,local]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
