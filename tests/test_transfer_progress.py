"""The progress line of a long transfer (a state download): bytes of the total, rate and ETA, at most every few
seconds; a clock passed in, so no test waits."""
from __future__ import annotations

import torch

from lean_transformer.swarm.hivemind_fixes.state_download import StateLayout
from lean_transformer.swarm.monitoring.transfer import MIB, TransferProgress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_few_seconds_with_bytes_rate_and_eta():
    clock = Clock()
    progress = TransferProgress("Downloading the state of peer", 400 * MIB, every_seconds=10, clock=clock)
    clock.now += 5
    assert progress.update(50 * MIB) is None  # not due yet
    clock.now += 5
    assert progress.update(100 * MIB) == \
        "Downloading the state of peer: 100.0 of 400.0 MiB (25%), 10.00 MiB/s, ETA 30 s"
    clock.now += 9
    assert progress.update(190 * MIB) is None  # 9 s after the last line
    clock.now += 1
    assert progress.update(200 * MIB) == \
        "Downloading the state of peer: 200.0 of 400.0 MiB (50%), 10.00 MiB/s, ETA 20 s"


def test_nothing_arrived_yet_says_the_eta_is_unknown():
    clock = Clock()
    progress = TransferProgress("x", 3 * MIB, every_seconds=1, clock=clock)
    clock.now += 2
    assert progress.update(0) == "x: 0.0 of 3.0 MiB (0%), 0.00 MiB/s, ETA unknown"


def test_the_download_counts_the_state_it_expects_uncompressed():
    layout = StateLayout(shapes=((1000, 1000), (10,)), dtypes=(torch.float32, torch.uint8), optimizer_skeleton=(),
                         min_epoch=0)
    assert [layout.tensor_bytes(0), layout.tensor_bytes(1)] == [4_000_000, 10]
    assert layout.max_bytes(1) == 10 + 2**20
