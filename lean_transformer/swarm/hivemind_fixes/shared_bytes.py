"""hivemind's futures between processes (``MPFuture``) keep their state in one byte of shared memory, cut from a
16-byte buffer (``SharedBytes``): every 16 futures take a new buffer, and with the ``file_system`` sharing strategy
that hivemind sets, each new buffer is a round trip to torch's shared-memory manager process, whose client gives up
after 1 s ("Shared memory manager connection has timed out"). A peer starved of CPU misses that second (its manager
runs under the same CPU quota): in benchmarks/internet.py (16 trainers on 2 cores), a trainer's progress tracker
raised it from ``dht.store`` and its thread ended, so the trainer stopped publishing its progress and reading the
swarm's; any other caller that creates a future (a DHT call, an averaging round) can meet it too.

Here (1) a buffer holds 4096 bytes, one page: the same shared memory per allocation as 16 bytes, and 256 times fewer
round trips to the manager (``HIVEMIND_SHM_BUFFER_SIZE`` still sets it); (2) an allocation that the manager did not
answer in time is tried again, for up to ``PATIENCE`` seconds, with one WARNING line, then raises as before.
Reproduced by ``tests/test_shared_bytes.py`` (the manager stopped with SIGSTOP under a progress tracker). Drop when
hivemind allocates its futures' state without torch's manager (not in 1.1.12).
"""
from __future__ import annotations

import logging
import os
import time

import torch
from hivemind.utils.mpfuture import SharedBytes

logger = logging.getLogger(__name__)

BUFFER_BYTES = 4096
PATIENCE = 30.0  # seconds: the manager answers within 1 s unless its process gets no CPU at all
_TIMED_OUT = "Shared memory manager connection has timed out"


def _patient(next_byte):
    def patient_next(cls) -> torch.Tensor:
        os.environ.setdefault("HIVEMIND_SHM_BUFFER_SIZE", str(BUFFER_BYTES))  # hivemind reads it at each allocation
        deadline, warned = time.monotonic() + PATIENCE, False
        while True:
            try:
                return next_byte(cls)
            except RuntimeError as error:
                if _TIMED_OUT not in str(error) or time.monotonic() >= deadline:
                    raise
                # a buffer kept from before a fork would be the parent's (hivemind sets the pid before allocating)
                cls._buffer = None
                if not warned:
                    logger.warning(f"torch's shared-memory manager did not answer in 1 s; trying again for up to "
                                   f"{PATIENCE:.0f} s")
                    warned = True

    patient_next.fixed, patient_next.original = True, next_byte
    return classmethod(patient_next)


def install() -> None:
    """Page-sized buffers and patient allocations in this process and those it forks later (idempotent)."""
    if not getattr(SharedBytes.next, "fixed", False):
        SharedBytes.next = _patient(SharedBytes.next.__func__)
