"""Audio in requests: WAV bytes decoded and resampled (``wav``, ``resample``), then turned into the
log-mel features a Whisper-style encoder takes (``log_mel``). Numpy only; nothing here knows gRPC,
the engine or ONNX Runtime."""
