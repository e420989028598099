"""One process of a two-process job that only stays alive: `python peer_watch_worker.py COORDINATOR ID DONE_FILE`.

Joins the job through `axcore.platform.distributed.initialize_distributed` (which starts
`axcore.platform.peer_watch`, logging its address at INFO), then runs one broadcast over the
job's devices every 0.05 s until process 0 sees DONE_FILE (process 0's view is the one
broadcast, so both leave on the same round), at most `MAX_SECONDS`; prints
`rounds: N` and exits 0. Run with `JAX_PLATFORMS=cpu`.
"""

import logging
import pathlib
import sys
import time

import numpy as np

from axcore.platform.distributed import distributed_settings, initialize_distributed

# Seconds the job stays alive at most, whether or not DONE_FILE appears.
MAX_SECONDS = 120


def main(coordinator: str, process_id: int, done: pathlib.Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    initialize_distributed(distributed_settings(coordinator, 2, process_id, environ={}))
    from jax.experimental import multihost_utils

    deadline = time.monotonic() + MAX_SECONDS
    rounds = 0
    while True:
        stop = process_id == 0 and (done.exists() or time.monotonic() > deadline)
        if multihost_utils.broadcast_one_to_all(np.int32(stop)):
            break
        rounds += 1
        time.sleep(0.05)
    print(f"rounds: {rounds}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]))
