"""Catching up on missed outer rounds: a DiLoCo peer a few outer steps behind its group replays the averages it
missed, taken from a groupmate's short history, instead of downloading the whole state.

Why: in benchmarks/internet.py (6 DiLoCo trainers + aux, 120 s, 20-100 Mbit/s links, 20-150 ms, NAT, churn),
``outer_state`` downloads (a group converged on another outer state than the peer's) were 14 of the 19 downloads
after joining, and in 11 of the 17 groups that outvoted a peer it was 1-3 outer steps behind: a missed round, or a
downloaded state that landed as the swarm took its next step. Each then fetched the whole state (parameters, outer
anchor and momentum, the inner optimizer's statistics) where what it lacked is a few averages: with top-k, 1% of
the values per group member and round.

How: each peer keeps the sparse averages of its last outer steps (:class:`OuterHistory`: at most ``HISTORY_ROUNDS``
and one float32 anchor's bytes), each under the fingerprint of the outer state it was applied to. Only sparse ones:
with top-k (the slow-link flags) an average holds a few percent of the values; a dense average is as large as the
anchor, and a history of them (the missed step, and the group's next one, which the donor may already hold) would
double the outer state's host memory, 8 bytes per parameter, to spare a download about twice its size. Its
outer averager serves them through hivemind's state-download RPC, which that averager had no other use for (and
which authorized swarms gate like the rest: ``GatedRPCs``). A peer whose group converged on a fingerprint further
on than its own asks the groupmates that hold it, one at a time (:meth:`FetchesOuterHistory.fetch_history`), and
applies the entry for its own fingerprint, then the entry for the fingerprint that gives, and so on until it holds
the group's, bit for bit (the outer step is deterministic); then it applies the round as its groupmates did. Each
entry names the state it led to, so the peer finds the whole path from its state to the group's in an answer
(:func:`path_to`) before it changes anything. A gap, a mismatch, a malformed answer or a timeout falls back to the
download (``diloco.OuterLoop._catch_up``).

Groupmates first, then other full peers: a client-mode peer (behind NAT) accepts no connection and serves nothing, and
in a 16-trainer run (benchmarks/internet.py, a quarter of them NAT'ed) the three catch-ups that failed had only
client-mode groupmates at the group's state; other full trainers, in other groups of the same rounds, held the
steps. Such a peer's history is used only if it holds the whole path, so a peer on another branch changes nothing.

Trust: the fingerprint is a checksum, not a hash, so a liar could forge an average that gives the group's
checksum. A replayed average passes the plausibility check of a group's average (``diloco.implausible_average``,
with ``--aggregation centered_clip``), and a forged anchor parts from its group's at the next round, which sends
the peer to download.
"""
from __future__ import annotations

import asyncio
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from lean_transformer.swarm.hivemind_fixes.stream_answers import UntilStateEnd
from lean_transformer.swarm.protocol.settings import HISTORY_ROUNDS

HISTORY_OUTSIDERS = 2  # full peers outside the group asked for a history after the groupmates
HISTORY_BYTES_PER_VALUE = 4  # ... within one float32 anchor's bytes
Key = Tuple[float, int]


def history_key(tag: Any) -> Optional[Key]:
    """An outer-state fingerprint ([outer steps, anchor checksum], ``diloco.OuterLoop.fingerprint``) as a key, or
    None if ``tag`` is not one (a peer's message: anything)."""
    if not isinstance(tag, (list, tuple)) or len(tag) != 2:
        return None
    steps, checksum = tag
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or not math.isfinite(steps):
        return None
    if isinstance(checksum, bool) or not isinstance(checksum, int):
        return None
    return float(steps), checksum


@dataclass(frozen=True)
class HistoryEntry:
    """One applied outer average over the anchor's values concatenated: ``values`` at ``indices`` (int64), zero
    elsewhere; ``after``: the fingerprint of the state it led to."""

    indices: torch.Tensor
    values: torch.Tensor
    after: Key

    @property
    def bytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()


class OuterHistory:
    """The sparse averages of this peer's last outer steps, each under the fingerprint of the state it was applied
    to."""

    def __init__(self, shapes: Sequence[torch.Size], rounds: int = HISTORY_ROUNDS):
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.total = sum(shape.numel() for shape in self.shapes)
        self.rounds = rounds
        self._entries: "OrderedDict[Key, HistoryEntry]" = OrderedDict()
        self._lock = threading.Lock()  # recorded by the optimizer's thread, served by hivemind's

    def record(self, before: Sequence, averaged: Sequence[torch.Tensor], after: Sequence) -> None:
        """Keep ``averaged``, the outer gradient that took the state whose fingerprint was ``before`` to ``after``, if
        at most a third of its values are non-zero (12 bytes each, index and value, against 4 for every value)."""
        key, after_key = history_key(list(before)), history_key(list(after))
        flat = torch.cat([tensor.detach().reshape(-1).to("cpu", torch.float32) for tensor in averaged])
        nonzero = flat.nonzero().squeeze(1)
        if key is None or after_key is None or nonzero.numel() * 3 >= self.total:
            return
        entry = HistoryEntry(nonzero, flat[nonzero].clone(), after_key)
        budget = HISTORY_BYTES_PER_VALUE * self.total
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = entry
            while len(self._entries) > self.rounds or sum(e.bytes for e in self._entries.values()) > budget:
                self._entries.popitem(last=False)

    def snapshot(self) -> Tuple[dict, List[torch.Tensor]]:
        """What this peer serves: metadata (per entry, oldest first, the fingerprints before and after it) and two
        tensors per entry (indices, values)."""
        with self._lock:
            entries = list(self._entries.items())
        tensors = [tensor for _, entry in entries for tensor in (entry.indices, entry.values)]
        return {"outer_history": [[list(key), list(entry.after)] for key, entry in entries]}, tensors

    def parse(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> Dict[Key, HistoryEntry]:
        """A groupmate's :meth:`snapshot`, checked against this peer's shapes; ValueError says what is wrong."""
        keys = metadata.get("outer_history") if isinstance(metadata, dict) else None
        if not isinstance(keys, list) or len(keys) > self.rounds or len(tensors) != 2 * len(keys):
            raise ValueError(f"not an outer history of at most {self.rounds} entries ({len(tensors)} tensors)")
        entries = {}
        for index, tags in enumerate(keys):
            key, after = (history_key(tags[0]), history_key(tags[1])) if isinstance(tags, list) and len(tags) == 2 \
                else (None, None)
            indices, values = tensors[2 * index], tensors[2 * index + 1]
            if key is None or after is None:
                raise ValueError(f"entry {index}: {tags!r} is not a pair of outer-state fingerprints")
            if after[0] != key[0] + 1:
                raise ValueError(f"entry {index}: a step from {key[0]:g} outer steps to {after[0]:g}")
            if indices.dtype != torch.int64 or values.dtype != torch.float32 or indices.dim() != 1 \
                    or values.dim() != 1:
                raise ValueError(f"entry {index}: {indices.dtype} indices and {values.dtype} values, not 1-D int64 "
                                 f"and float32")
            if indices.numel() != values.numel() or (indices.numel() > 0 and (
                    int(indices.min()) < 0 or int(indices.max()) >= self.total)):
                raise ValueError(f"entry {index}: {indices.numel()} indices (not each within [0, {self.total})) for "
                                 f"{values.numel()} values")
            entries[key] = HistoryEntry(indices, values, after)
        return entries

    def dense(self, entry: HistoryEntry) -> List[torch.Tensor]:
        """The entry as one float32 tensor per anchor tensor."""
        flat = torch.zeros(self.total, dtype=torch.float32)
        flat[entry.indices] = entry.values
        return [part.view(shape) for part, shape in zip(flat.split([s.numel() for s in self.shapes]), self.shapes)]


def path_to(entries: Dict[Key, HistoryEntry], start: Sequence, goal: Sequence) -> Optional[List[Key]]:
    """The fingerprints from which ``entries`` (a parsed history) lead, one step each, from ``start`` to ``goal``, in
    order; None if they do not (a gap, or another branch)."""
    key, goal_key, path = history_key(list(start)), history_key(list(goal)), []
    while key is not None and key != goal_key and key in entries and len(path) < len(entries):
        path.append(key)
        key = entries[key].after
    return path if key is not None and key == goal_key and path else None


class ServesOuterHistory:
    """Mixed in front of the outer averager (``diloco._Averager``): hivemind's state-download RPC serves
    :attr:`outer_history` (set in the host process), and :meth:`fetch_history` reads a groupmate's."""

    outer_history: Optional[OuterHistory] = None

    async def _declare_for_download_periodically(self) -> None:
        """Executed in the averager's process: nothing. A history is fetched from a groupmate by its peer ID, never
        from the DHT's list of donors, where hivemind's loop would store this averager every period for nothing (and
        log a traceback for each store that outlives its period: ``hivemind_fixes.store_outcomes``)."""

    def get_current_state(self) -> Tuple[dict, List[torch.Tensor], None]:
        """Executed in the host process, for a peer that downloads this averager's state: the outer history."""
        if self.outer_history is None:
            return {"outer_history": []}, [], None
        return (*self.outer_history.snapshot(), None)

    def fetch_history(self, peer: str, timeout: float, max_bytes: int) -> Tuple[Any, List[torch.Tensor]]:
        """``peer``'s served metadata and tensors, within ``timeout`` seconds and ``max_bytes`` of tensor data;
        raises on a failure, a refusal (nothing sent) or a larger answer."""
        future = MPFuture()
        self._outer_pipe.send(("_fetch_history", [], dict(peer=peer, timeout=timeout, max_bytes=max_bytes,
                                                           future=future)))
        return future.result(timeout + 5)

    async def _fetch_history(self, peer: str, timeout: float, max_bytes: int, future: MPFuture) -> None:
        """Executed in the averager's process."""
        try:
            future.set_result(await asyncio.wait_for(self._read_history(peer, max_bytes), timeout))
        except BaseException as error:
            if not future.done():
                future.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))

    async def _read_history(self, peer: str, max_bytes: int) -> Tuple[Any, List[torch.Tensor]]:
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        answers = UntilStateEnd(await stub.rpc_download_state(averaging_pb2.DownloadRequest()))
        metadata, parts, tensors, received = None, [], [], 0
        try:
            async for message in answers:
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                received += len(message.tensor_part.buffer)
                if received > max_bytes:
                    raise ValueError(f"{peer} sent more than {max_bytes} bytes of outer history")
                if message.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                if message.tensor_part.dtype or parts:
                    parts.append(message.tensor_part)
        finally:
            await answers.aclose()
        if metadata is None:
            raise ValueError(f"{peer} sent no outer history")
        if not answers.whole:
            raise ValueError(f"{peer}'s outer history was cut after {len(tensors)} tensors")
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return metadata, tensors
