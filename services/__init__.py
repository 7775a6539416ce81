"""kvshare's worker, router and tools.

ONNX Runtime 1.29+ sends usage telemetry from Linux too, starting at import. A worker serving
private prompts, often in a cluster without egress, must not phone home, so every kvshare process
opts out before any module imports ONNX Runtime (ONNX Runtime GenAI included). Setting
ORT_DISABLE_TELEMETRY=0 in the environment keeps ONNX Runtime's own default.
"""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
