"""`kvshare route`: an optional, stateless gRPC router in front of workers.

Every call of ``kvshare.v1.Generator`` is forwarded as raw bytes to one worker. Generate calls go
to the worker that rendezvous hashing picks for the beginning of their prompt, so that requests
sharing a prefix meet the K/V that worker already holds in its memory L1 (and its single-flight);
other calls go round-robin. ``docs/route.md`` says how to deploy it and what it does not do.

- ``config``: the router's settings (flags and ``KVSHARE_ROUTE_*`` variables);
- ``routing_key``: the key of a Generate request (prompt prefix, cache salt, caller);
- ``rendezvous``: which worker a key goes to, under a load bound;
- ``upstreams``: the worker set, its discovery (static or DNS) and health checks;
- ``attempt``: one try of a call at one worker, bounded so that a frozen worker cannot hold it;
- ``proxy``: the forwarding of calls, statuses, metadata, deadlines, cancellation and retries;
- ``server``: the gRPC server around them, its health service and shutdown.
"""
