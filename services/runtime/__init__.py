"""The model runtime: model folders, ONNX Runtime sessions, K/V slots and the tokenizer. Imports
nothing from the builder or the engine."""
