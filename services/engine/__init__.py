"""The engine: request validation, the scheduler that batches every sequence of a worker, sampling
and text streaming. Knows models, tokens and a store interface; knows nothing of gRPC."""
