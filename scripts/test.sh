#!/usr/bin/env bash
# Runs the whole test suite in .venv/ (created and filled on first use). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
# Test tools that are not Python packages (helm) are fetched here, so that the tests need no network.
"$py" tests/tools.py >/dev/null
set +e
"$py" -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
