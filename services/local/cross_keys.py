"""Waiting for a replica's cross-attention K/V to reach Redis, for local runs (the speech demo, the
Whisper benchmark) that ask another replica next: the publish runs off the token path, after the
first replica has answered, so without the wait the second replica may miss it."""

from __future__ import annotations

import time

import redis

from cachestore.keys import KEY_PREFIX

CROSS_KEYS = KEY_PREFIX + "xkv:*"


def wait_for_cross_keys(client: redis.Redis, count: int, timeout_s: float = 30.0) -> None:
    """Returns once Redis holds ``count`` cross-attention K/V values; raises TimeoutError after
    ``timeout_s`` seconds without them."""
    deadline = time.monotonic() + timeout_s
    while sum(1 for _ in client.scan_iter(match=CROSS_KEYS, count=1000)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} cross-attention K/V values not in Redis after {timeout_s:g} s")
        time.sleep(0.005)
