#!/usr/bin/env bash
# Writes the images' dependency locks, requirements/cpu.txt and requirements/gpu.txt: kvshare's runtime
# dependencies with the `cpu` or `gpu` extra (never test/local), resolved for CPython 3.11 on linux
# x86_64 (manylinux_2_28: both base images have a newer glibc), every wheel and sdist with its sha256.
# Versions already in a lock are kept while pyproject.toml allows them, so a second run writes the same
# files; `bash scripts/lock.sh --upgrade` moves every pin to the newest version allowed.
# uv (pinned below) is installed into .venv/ when missing; the rest of .venv/ is not needed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv_version="0.9.28"
uv="$root/.venv/bin/uv"

if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  [ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv" >&2
  echo "kvshare: installing uv $uv_version into $root/.venv" >&2
  "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version" >&2
fi

cd "$root"
mkdir -p requirements
for extra in cpu gpu; do
  # --no-config: a user's uv.toml (another index, other defaults) must not change the lock.
  "$uv" pip compile pyproject.toml --quiet --no-config --extra "$extra" --generate-hashes \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "bash scripts/lock.sh" "$@" -o "requirements/$extra.txt"
done
