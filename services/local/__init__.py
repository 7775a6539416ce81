"""Local process helpers used by the demo, the benchmarks and the tests: a redis-server and
`kvshare serve` subprocesses on loopback ports, a TCP proxy that can cut connections, client-side
traffic (``traffic``), and the lab of store faults under that traffic (``store_faults``)."""
