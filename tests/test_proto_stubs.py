"""The committed gRPC stubs are what `scripts/gen_proto.py` makes from proto/ today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_proto(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stale stubs, run scripts/gen_proto.py: {stale}"
