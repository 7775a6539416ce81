"""The engine: an input processor, a KV connector, a scheduler that plans steps, a model runner
that runs them, and an output processor, wired by ``engine.Engine``. Knows models, tokens and a
store interface; knows nothing of gRPC."""
