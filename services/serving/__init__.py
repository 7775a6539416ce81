"""What kvshare's two servers, `kvshare serve` (services/api/) and `kvshare route`
(services/route/), share, kept below both so that neither imports the other:

- ``flags``: settings dataclasses read from command-line flags over environment variables;
- ``graceful``: the end of a server's life on SIGTERM (NOT_SERVING, then draining).
"""
