"""Local process helpers used by the demo, the benchmarks and the tests: a redis-server and
`kvshare serve` subprocesses on loopback ports."""
