"""The gRPC face: servicer, server, client, configuration and the `kvshare` command."""
