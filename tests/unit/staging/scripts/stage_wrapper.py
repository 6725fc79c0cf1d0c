"""Run ``python -m shardio ARGS`` with test hooks set by environment variables.

STAGE_TEST_BARRIER=PATH   wait (after imports) until PATH exists, so processes start together.
STAGE_TEST_DELAY_S=SEC    sleep this long before each verified copy (shardio.staging.copy's
                          copy_verified, as staging calls it), so a kill lands mid-staging.
STAGE_TEST_HOLD_AT=K      before publishing the K-th shard copy (1-based), write its temp
                          file completely and then block, so a kill leaves a temp file behind.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time

import shardio.staging.copy as cache_copy
import shardio.staging.verified as verified_copy

barrier = os.environ.get("STAGE_TEST_BARRIER")
delay_s = float(os.environ.get("STAGE_TEST_DELAY_S", "0"))
hold_at = int(os.environ.get("STAGE_TEST_HOLD_AT", "0"))

if delay_s > 0:
    original_copy = cache_copy.copy_verified

    def slow_copy(*args: object, **kwargs: object) -> int:
        time.sleep(delay_s)
        return original_copy(*args, **kwargs)  # type: ignore[arg-type]

    cache_copy.copy_verified = slow_copy  # type: ignore[assignment]

if hold_at > 0:
    original_publish = verified_copy.publish
    lock = threading.Lock()
    published = [0]

    def holding_publish(tmp: str, final: str, *, durable: bool = True) -> None:
        if f"{os.sep}shards{os.sep}" in final:
            with lock:
                published[0] += 1
                hold = published[0] == hold_at
            if hold:
                time.sleep(3600)  # killed here, with the complete temp file on disk
        original_publish(tmp, final, durable=durable)

    verified_copy.publish = holding_publish  # type: ignore[assignment]

if barrier:
    deadline = time.monotonic() + 60
    while not os.path.exists(barrier):
        if time.monotonic() > deadline:
            sys.exit("stage_wrapper: barrier never opened")
        time.sleep(0.001)

sys.argv = ["shardio", *sys.argv[1:]]
runpy.run_module("shardio", run_name="__main__", alter_sys=True)
