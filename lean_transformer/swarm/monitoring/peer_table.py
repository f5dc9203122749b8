"""The aux peer's table of contributors: one row per trainer that has published metrics, kept across refreshes.

A row says who the peer is (its owner key's fingerprint, and the libp2p ID and client mode its record claims), how
fast it trains, how many samples it contributed (each epoch counted once, from the reports its records carry), when
its record last advanced, and in what share of its epochs it averaged with others. The table is written to the JSONL
history as its own row kind (:class:`PeerSnapshot`) and served on the live page.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Collection, Dict, Hashable, List, Mapping, Optional

from lean_transformer.swarm.protocol.metrics import LocalMetrics


def key_id(public_key: bytes) -> str:
    """A short, stable name for a record's owner key (the only identity a metrics record proves)."""
    return hashlib.sha256(public_key).hexdigest()[:12]


@dataclass(frozen=True)
class PeerRow:
    """One contributor. ``samples`` counts the samples of the epochs the aux peer has seen reports of;
    ``last_seen`` is when its record last advanced to a new epoch; ``alive`` whether its record is in the DHT now.
    ``excluded``: more than half of the other alive trainers that report exclusions (records with ``excluded``) list
    this peer's ID (one liar cannot get an honest peer marked by listing it). Optional fields are ``None`` for
    trainers whose records predate them."""

    key: str
    peer_id: Optional[str]
    client_mode: Optional[bool]
    epoch: int
    samples_per_second: float
    samples: int
    last_seen: float
    rounds_attempted: Optional[int]
    rounds_averaged: Optional[int]
    alive: bool
    excluded: bool = False

    @property
    def averaged_fraction(self) -> Optional[float]:
        if not self.rounds_attempted:
            return None
        return self.rounds_averaged / self.rounds_attempted

    def to_dict(self) -> dict:
        return {**asdict(self), "averaged_fraction": self.averaged_fraction}

    @classmethod
    def from_dict(cls, row: Mapping) -> "PeerRow":
        optional_int = lambda name: None if row.get(name) is None else int(row[name])  # noqa: E731
        return cls(key=str(row["key"]), peer_id=None if row.get("peer_id") is None else str(row["peer_id"]),
                   client_mode=None if row.get("client_mode") is None else bool(row["client_mode"]),
                   epoch=int(row["epoch"]), samples_per_second=float(row["samples_per_second"]),
                   samples=int(row["samples"]), last_seen=float(row["last_seen"]),
                   rounds_attempted=optional_int("rounds_attempted"), rounds_averaged=optional_int("rounds_averaged"),
                   alive=bool(row["alive"]), excluded=bool(row.get("excluded", False)))


@dataclass(frozen=True)
class PeerSnapshot:
    """The whole table at ``time``, most samples first: a row of the JSONL history (``{"peers": [...], "time"}``)."""

    peers: List[PeerRow]
    time: float

    def to_dict(self) -> dict:
        return {"peers": [row.to_dict() for row in self.peers], "time": self.time}

    @classmethod
    def from_dict(cls, row: Mapping) -> "PeerSnapshot":
        return cls(peers=[PeerRow.from_dict(peer) for peer in row["peers"]], time=float(row["time"]))


@dataclass
class _Counted:
    row: PeerRow
    counted_through: int = field(default=-1)  # the newest epoch whose samples are in row.samples


class PeerTable:
    """Keeps a row per owner key; peers whose records are gone stay as not alive, and the ``max_peers`` most
    recently seen are kept (memory stays bounded in a long run with churn)."""

    def __init__(self, max_peers: int = 1000):
        if max_peers <= 0:
            raise ValueError(f"max_peers must be positive, got {max_peers}")
        self.max_peers = max_peers
        self._peers: Dict[str, _Counted] = {}

    def restore(self, snapshot: PeerSnapshot) -> None:
        """Continue from a snapshot that an earlier run of the aux peer wrote (the counts go on from it)."""
        for row in snapshot.peers:
            self._peers[row.key] = _Counted(replace(row, alive=False), counted_through=row.epoch)
        self._evict()

    def update(self, records: Mapping[Hashable, LocalMetrics], now: float,
               excluded: Optional[Collection[str]] = None) -> None:
        """Fold in the records currently in the DHT (owner key -> record); ``excluded``: keys of peers that robust
        aggregation excludes (by default: those the records' ``excluded`` lists mark, see :func:`excluded_keys`)."""
        excluded = excluded_keys(records) if excluded is None else excluded
        for entry in self._peers.values():
            entry.row = replace(entry.row, alive=False)
        for public_key, record in records.items():
            key = key_id(public_key)
            entry = self._peers.get(key)
            if entry is None:
                entry = self._peers[key] = _Counted(PeerRow(
                    key=key, peer_id=None, client_mode=None, epoch=record.epoch, samples_per_second=0.0, samples=0,
                    last_seen=now, rounds_attempted=None, rounds_averaged=None, alive=True))
            new = [report for report in record.reports() if report.epoch > entry.counted_through]
            advanced = record.epoch != entry.row.epoch or entry.counted_through < 0
            entry.counted_through = max(entry.counted_through, record.epoch)
            entry.row = PeerRow(
                key=key, peer_id=record.peer_id, client_mode=record.client_mode, epoch=record.epoch,
                samples_per_second=record.samples_per_second,
                samples=entry.row.samples + sum(report.samples_accumulated for report in new),
                last_seen=now if advanced else entry.row.last_seen, rounds_attempted=record.rounds_attempted,
                rounds_averaged=record.rounds_averaged, alive=True, excluded=key in excluded)
        self._evict()

    def rows(self) -> List[PeerRow]:
        """Most contributed samples first."""
        return sorted((entry.row for entry in self._peers.values()), key=lambda row: (-row.samples, row.key))

    def snapshot(self, now: float) -> PeerSnapshot:
        return PeerSnapshot(self.rows(), now)

    def _evict(self) -> None:
        if len(self._peers) > self.max_peers:
            newest = sorted(self._peers, key=lambda key: self._peers[key].row.last_seen)[-self.max_peers:]
            self._peers = {key: self._peers[key] for key in newest}


def excluded_keys(records: Mapping[Hashable, LocalMetrics]) -> set:
    """Keys (:func:`key_id`) of the peers that more than half of the other reporting trainers exclude: those whose
    records carry ``excluded`` (older records do not report, and are not counted)."""
    reporters = {key_id(public_key): record for public_key, record in records.items() if record.excluded is not None}
    marked = set()
    for public_key, record in records.items():
        if record.peer_id is None:
            continue
        others = [other for key, other in reporters.items() if key != key_id(public_key)]
        votes = sum(record.peer_id in other.excluded for other in others)
        if others and votes > len(others) / 2:
            marked.add(key_id(public_key))
    return marked


def summary(rows: List[PeerRow]) -> str:
    """The table in a few words, for the status line: alive peers, client mode, the share of rounds averaged."""
    alive = [row for row in rows if row.alive]
    if not alive:
        return "no trainer reporting"
    clients = sum(bool(row.client_mode) for row in alive)
    text = f"{len(alive)} trainer{'s' if len(alive) != 1 else ''} ({clients} client mode)"
    fractions = [(row.averaged_fraction, row) for row in alive if row.averaged_fraction is not None]
    if fractions:
        lowest, slowest = min(fractions, key=lambda pair: pair[0])
        text += (f", averaged in {sum(f for f, _ in fractions) / len(fractions):.0%} of rounds "
                 f"(lowest {lowest:.0%}: {display_name(slowest)})")
    excluded = [row for row in alive if row.excluded]
    if excluded:
        text += f", {len(excluded)} excluded ({', '.join(display_name(row) for row in excluded)})"
    return text


def display_name(row: PeerRow) -> str:
    """The last characters of the peer's libp2p ID (as hivemind's logs shorten it), else its key's fingerprint."""
    return f"...{row.peer_id[-8:]}" if row.peer_id else f"key {row.key}"
