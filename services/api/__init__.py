"""The worker's gRPC face: servicer, server, configuration, API keys, logs and metrics."""
