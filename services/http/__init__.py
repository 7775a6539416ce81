"""The OpenAI-compatible HTTP face: /v1/chat/completions, /v1/completions,
/v1/audio/transcriptions, /v1/models and /health, translated to gRPC ``Generate`` calls.

It is a gRPC client and nothing more: it knows the API's messages, never the engine. ``kvshare
serve --http-port`` points it at the worker's own gRPC server, ``kvshare route --http-port`` at the
router's (which routes each call by its prompt's leading bytes), both over a private Unix socket.
"""
