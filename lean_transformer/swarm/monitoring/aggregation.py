"""Turns the per-peer metrics records that trainers publish into one row of swarm-wide statistics per epoch."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Hashable, List, Mapping, Protocol, Sequence, Tuple


class EpochReport(Protocol):
    """One trainer's work in one epoch, as the aggregation reads it."""

    epoch: int
    samples_per_second: float
    samples_accumulated: int
    loss_sum: float
    mini_steps: int


class PeerRecord(EpochReport, Protocol):
    """A trainer's (already validated) metrics record: its latest epoch, and the earlier ones it repeats."""

    def reports(self) -> Sequence[EpochReport]:
        """Every epoch the record covers, oldest first, its own epoch last."""


@dataclass(frozen=True)
class SwarmStats:
    """The swarm's progress in one global epoch.

    ``loss`` is the swarm-wide mean loss per mini-step, i.e. sum of the peers' loss sums over the sum of their
    mini-steps (not a mean of per-peer means, which would over-weight slow peers); NaN if no mini-step was reported.
    """

    epoch: int
    alive_peers: int
    loss: float
    samples_per_second: float
    samples_in_epoch: int
    mini_steps: int
    time: float

    def to_dict(self) -> dict:
        row = asdict(self)
        if math.isnan(self.loss):
            row["loss"] = None  # JSON has no NaN
        return row

    @classmethod
    def from_dict(cls, row: Mapping) -> "SwarmStats":
        loss = row.get("loss")
        return cls(
            epoch=int(row["epoch"]),
            alive_peers=int(row["alive_peers"]),
            loss=float("nan") if loss is None else float(loss),
            samples_per_second=float(row["samples_per_second"]),
            samples_in_epoch=int(row["samples_in_epoch"]),
            mini_steps=int(row.get("mini_steps", 0)),
            time=float(row["time"]),
        )


def aggregate(epoch: int, records: Sequence[EpochReport], now: float) -> SwarmStats:
    """Combine the records that peers published for one epoch."""
    mini_steps = sum(record.mini_steps for record in records)
    loss_sum = sum(record.loss_sum for record in records)
    return SwarmStats(
        epoch=epoch,
        alive_peers=len(records),
        loss=loss_sum / mini_steps if mini_steps > 0 else float("nan"),
        samples_per_second=float(sum(record.samples_per_second for record in records)),
        samples_in_epoch=sum(record.samples_accumulated for record in records),
        mini_steps=mini_steps,
        time=now,
    )


class EpochCollector:
    """Collects the trainers' reports of each epoch across refreshes and releases an epoch's statistics once it is
    complete.

    Each peer keeps one record in the DHT and overwrites it every epoch; the record repeats the peer's last few epochs,
    so the reports of every epoch it covers are copied into per-epoch buckets as they are seen: a refresh that comes
    less often than the epochs change still counts every trainer of every epoch that some record still covers (epochs
    no record covers any more get no row rather than an undercounted one). Epoch E is complete when every peer with a
    record (a trainer publishes one as it joins, which reports no epoch) has reached E or later, or when some peer is
    more than ``lag`` epochs past E: a peer that left (its last record lives on until it expires) must not hold the
    log back for ever, and one that is up to ``lag`` epochs behind the fastest still gets its report of E counted.
    But not while a record below E still moves, that is, its epoch advanced since the newest epoch among the records
    was ``stale_after`` epochs lower: a trainer that trains labels behind the fastest (a newcomer, or a group whose
    round a kill delayed) advances with the swarm, and "some peer is two epochs past E" wrote rows of a gradient-mode
    run without it (benchmarks/internet.py: rows 13 and 14 of 18 missed a trainer that reached those epochs 0-1.5 s
    before them). A record that stopped moving (its peer left, or is stuck) holds nothing back beyond ``lag``.
    Released epochs are dropped, so memory does not grow with the run.
    """

    def __init__(self, last_released_epoch: int = -1, lag: int = 1, stale_after: int = 2):
        self.last_released_epoch, self.lag, self.stale_after = last_released_epoch, lag, stale_after
        self._buckets: Dict[int, Dict[Hashable, EpochReport]] = {}
        self._moved: Dict[Hashable, Tuple[int, int]] = {}  # peer key -> (its record's epoch, the newest epoch then)

    def update(self, records: Mapping[Hashable, PeerRecord], now: float) -> List[SwarmStats]:
        """Add the records currently in the DHT (peer key -> record); return the statistics of newly complete epochs,
        oldest first."""
        for peer, record in records.items():
            for report in record.reports():
                if report.epoch > self.last_released_epoch:
                    self._buckets.setdefault(report.epoch, {})[peer] = report
        self._moved = {peer: moved for peer, moved in self._moved.items() if peer in records}  # expired: forgotten
        if not records:
            return []
        newest_epoch = max(record.epoch for record in records.values())
        for peer, record in records.items():
            if self._moved.get(peer, (None,))[0] != record.epoch:
                self._moved[peer] = (record.epoch, newest_epoch)
        slowest_epoch = min(record.epoch for record in records.values())
        # the newest record's peer moved when it reached that epoch: never empty
        slowest_moving = min(record.epoch for peer, record in records.items()
                             if newest_epoch - self._moved[peer][1] < self.stale_after)

        released = []
        for epoch in sorted(self._buckets):
            if epoch > slowest_moving or not (epoch <= slowest_epoch or epoch < newest_epoch - self.lag):
                break
            released.append(aggregate(epoch, list(self._buckets.pop(epoch).values()), now))
            self.last_released_epoch = epoch
        return released
