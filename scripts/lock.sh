#!/usr/bin/env bash
# Writes the project's dependency locks, every wheel and sdist with its sha256:
#   requirements/dev.txt  the environment scripts/venv.sh builds for the demo, the tests and development:
#                         the runtime dependencies with the `cpu`, `test` and `local` extras and the build
#                         backend (pyproject.toml's [build-system]), resolved for every platform and for
#                         CPython 3.11 to 3.13 at once (markers where a pin differs between them);
#   requirements/cpu.txt, requirements/gpu.txt  the images' locks: the runtime dependencies with the `cpu`
#                         or `gpu` extra (never test/local), for CPython 3.11 on linux x86_64
#                         (manylinux_2_28: both base images have a newer glibc).
# The images' lock is written first and seeds the development lock, so a package both hold has the same
# version in both (tests/test_locks.py checks it): the tests run what the images ship.
# Versions already in a lock are kept while pyproject.toml allows them, so a second run writes the same
# files; `bash scripts/lock.sh --upgrade` moves every pin to the newest version allowed (then regenerate
# the gRPC stubs with scripts/gen_proto.py: tests/test_proto_stubs.py compares them with the locked
# grpcio-tools' output).
# uv (pinned below) runs from a virtualenv of its own in the user's cache, made when missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv_version="0.9.28"
tool_venv="${XDG_CACHE_HOME:-$HOME/.cache}/kvshare/tools/uv-$uv_version"
uv="$tool_venv/bin/uv"

if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  echo "kvshare: installing uv $uv_version into $tool_venv" >&2
  mkdir -p "$(dirname "$tool_venv")"
  python3 -m venv "$tool_venv" >&2
  "$tool_venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version" >&2
fi

cd "$root"
mkdir -p requirements
# --no-config: a user's uv.toml (another index, other defaults) must not change a lock.
common=(--quiet --no-config --generate-hashes --custom-compile-command "bash scripts/lock.sh")
for extra in cpu gpu; do
  "$uv" pip compile pyproject.toml "${common[@]}" --extra "$extra" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 "$@" -o "requirements/$extra.txt"
done

# The build backend is locked too: venv.sh installs the project without build isolation, which would
# otherwise fetch whatever setuptools is newest.
build_requires="$("$tool_venv/bin/python" - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))
PY
)"
# A new development lock starts from the images' pins.
[ -f requirements/dev.txt ] || cp requirements/cpu.txt requirements/dev.txt
printf '%s\n' "$build_requires" | "$uv" pip compile pyproject.toml - "${common[@]}" \
  --extra cpu --extra test --extra local --universal --python-version 3.11 "$@" -o requirements/dev.txt
