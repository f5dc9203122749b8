"""Run a trainer on a simulated slow accelerator: every micro-batch first sleeps ``SLOW_BATCH_SECONDS``.

Volunteers' GPUs differ by 10x; a sleep per micro-batch makes one trainer of a loopback swarm that much slower without
taking CPU from the others (a CPU quota would, on a 2-core box, also slow its averager and its DHT, which a slow GPU
does not). Usage: python tests/slow_trainer.py run_trainer.py [ARGS...]
"""
import os
import runpy
import sys
import time

_delay = float(os.environ.get("SLOW_BATCH_SECONDS", "1"))

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as if SCRIPT had been run directly
    from tasks.causal_lm import PackedBatcher

    next_batch = PackedBatcher.next_batch

    def slow_next_batch(self, batch_size: int, sequence_length: int):
        time.sleep(_delay)
        return next_batch(self, batch_size, sequence_length)

    PackedBatcher.next_batch = slow_next_batch
    runpy.run_path(sys.argv[0], run_name="__main__")
