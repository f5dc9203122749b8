"""Peer events: what a peer did, as one JSON object per line, beside its human log.

The log is for people; events are for programs (the demo, the benchmarks, the tests, an aux peer's live page). Each
line is a self-contained JSON object::

    {"v": 1, "time": 1764100000.25, "peer": "12D3KooW...", "role": "trainer", "event": "epoch", "epoch": 3, ...}

``v`` is :data:`SCHEMA_VERSION`; it grows when a field changes meaning or goes away (new fields and new events do
not bump it: readers ignore what they do not know). ``time`` is Unix time in seconds, ``peer`` the peer's libp2p ID
(``None`` before its DHT starts), ``role`` ``"trainer"`` or ``"aux"``. The events and their fields:

====================  =================================================================================================
``joined``            ``epoch``, ``client_mode``, ``initial_peers`` (the addresses others join through; ``[]`` for a
                      client), ``from_swarm`` (whether it loaded the swarm's state)
``epoch``             the peer reached ``epoch``: ``loss`` (mean over the epoch it finished; ``null`` if none),
                      ``samples``, ``mini_steps``, ``skipped``, ``compute_seconds`` and ``wall_seconds`` (since start);
                      ``ended_by`` (``samples``, ``eta``, ``swarm_ahead`` or, DiLoCo, ``group``: why it stepped,
                      see ``SwarmOptimizer``'s ``EpochEnd``; ``null`` if it reached the epoch without a step) and
                      ``swarm_samples`` (the swarm's samples it counted then)
``progress``          (trainer) with each progress line: ``epoch``, ``peers`` (in the swarm, as hivemind sees it),
                      and since the training loop started: ``samples`` (computed), ``compute_seconds``,
                      ``compute_cpu_seconds`` (the training thread's CPU time in them), ``waiting_seconds`` (for the
                      swarm: outer rounds, downloads), ``wall_seconds``, ``loss_sum`` and ``losses`` (over the
                      micro-batches trained on); ``visible``: the peer IDs in the training-progress records of its
                      last DHT fetch; ``dht_lookup_seconds``: how long that fetch's lookup took (``null`` before one)
``round_started``     an averager began an averaging round (it looks for a group): ``kind`` (``gradients``,
                      ``parameters`` or ``outer``), ``epoch`` (the round's, where the averager knows it, else ``null``)
``averaged``          the round succeeded: ``kind``, ``epoch`` (as in ``round_started``), ``group_size``, ``bytes``
                      (sent by this peer, when known, else ``null``)
``round_missed``      the round failed, found no group, was cancelled, or only served its group with weight 0:
                      ``kind``, ``epoch``, ``reason`` (``cancelled``, ``leaving`` (cancelled or served as the peer
                      left: not a round it missed while training), ``served its group with weight 0``, or the error)
``group_rematched``   (DiLoCo) its round's group held less than half of the swarm's trainers: every member dissolved it
                      before the all-reduce and matched once more
                      (:mod:`lean_transformer.swarm.averaging.group_quorum`): ``kind``, ``group_size`` (its members,
                      aux peers included), ``reason``
``label_taken``       its last group had stepped from the epoch label one above its own: it took the group's label
                      ``epoch`` (from ``previous``) instead of downloading the state; no step of its own
``joined_early``      (gradient mode) the swarm's ``epoch`` ended during this peer's micro-batch, ``seconds_left`` (as
                      expected) before its end: it joined the round with the ``samples`` accumulated until then
                      (:mod:`~lean_transformer.swarm.averaging.early_join`)
``outer_step``        DiLoCo applied an outer step: ``epoch``, ``group_size``, ``outer_steps``
``state_downloaded``  loaded the swarm's state: ``epoch``, ``source`` (the donor's peer ID), ``seconds``,
                      ``scored`` (whether the loss check scored it), ``reason``: ``join`` (a trainer joining),
                      ``epoch`` (its epoch fell behind the swarm's), ``outer_state`` (DiLoCo: its last group
                      converged on another outer state), ``checkpoint`` (an aux peer's copy)
``outer_caught_up``   (DiLoCo) replayed the outer steps it missed from a groupmate's history instead of downloading
                      the state (:mod:`lean_transformer.swarm.averaging.outer_history`): ``source``, ``rounds``,
                      ``seconds``, ``went_back`` (the outer steps it first went back, 0 if none: its group had averaged
                      those rounds apart, or not at all)
``catch_up_failed``   (DiLoCo) was behind its group and no groupmate's history replayed the outer steps it missed
                      (it downloads the state): ``rounds`` (steps behind), ``kind`` (``too_far``, ``no_donor``,
                      ``not_in_history`` or ``replayed_elsewhere``), ``reason`` (for each donor asked)
``state_rejected``    refused a donor's state: ``source``, ``reason``
``peer_refused``      an averager refused a peer (authorized swarms): ``source``, ``reason``, ``service`` (the
                      averager's prefix)
``identity_revoked``  (authorized swarms) a revocation list took effect at this peer: one event per newly revoked
                      identity, ``source`` (its peer ID), ``issued_at`` (the list's), ``own`` (this peer itself)
``answer_rejected``   (robust aggregation) a reducer's answer failed this peer's check (it kept its own values for
                      that part): ``source`` (the reducer's peer ID), ``reason``, ``size`` (values in the part),
                      ``gross``, ``struck`` (a strike counted: not in a group out of step, unless gross)
``sender_clipped``    (robust aggregation) this peer's reducer found a sender's part far out: ``source``,
                      ``reason``, ``size``, ``struck``
``sender_dropped``    (DiLoCo, sparse) this peer's reducer averaged its range without a client-mode groupmate that
                      sent it nothing within ``seconds`` of the group forming: ``source``
``average_rejected``  (robust aggregation, DiLoCo) this peer did not apply an implausible outer average (a missed
                      round): ``group_size``, ``reason``
``peer_excluded``     (robust aggregation) a peer caught repeatedly is left out of this peer's groups: ``source``,
                      ``reason``, ``until`` (Unix time)
``settings_mismatch`` this peer's settings differ from the swarm's: ``differences`` (flag -> [ours, theirs])
``checkpoint``        (aux) wrote the swarm's state: ``epoch``, ``path``
``evaluation``        (aux) ``epoch``, ``validation_loss``
``swarm_epoch``       (aux) one epoch of the swarm's statistics: ``epoch``, ``loss``, ``samples``,
                      ``samples_per_second``, ``alive_peers``
``shutdown``          ``reason`` (``finished``, ``signal`` or ``error``), ``epoch`` (``null`` if unknown), ``clean``,
                      ``error`` (with ``error``: the exception, one line)
====================  =================================================================================================

Writing: a peer opens its stream once (:func:`open_events`) and any code of that process, or of a process forked from
it (hivemind's averagers), calls :func:`emit`. Each event is one ``write`` of one line to a file opened with
``O_APPEND``, so lines from several processes never interleave. Without an open stream :func:`emit` does nothing:
the library works the same when embedded without events.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Union

SCHEMA_VERSION = 1
EVENTS = ("joined", "epoch", "progress", "round_started", "averaged", "round_missed", "outer_step", "state_downloaded",
          "state_rejected", "peer_refused", "identity_revoked", "settings_mismatch", "checkpoint", "evaluation",
          "swarm_epoch", "shutdown", "answer_rejected", "sender_clipped", "peer_excluded", "average_rejected",
          "outer_caught_up", "catch_up_failed", "label_taken", "joined_early", "sender_dropped", "group_rematched")


class EventLog:
    """An append-only JSON-lines file of one peer's events."""

    def __init__(self, path: Union[str, Path], role: str, peer: Optional[str] = None):
        self.path, self.role, self.peer = Path(path), role, peer
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        """Append one event. ``event`` must be one of :data:`EVENTS`; NaN and infinities become ``null``."""
        if event not in EVENTS:
            raise ValueError(f"event: unknown event {event!r}, choose one of {', '.join(EVENTS)}")
        record = dict(v=SCHEMA_VERSION, time=time.time(), peer=self.peer, role=self.role, event=event)
        record.update({name: _plain(value) for name, value in fields.items()})
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


_current: Optional[EventLog] = None


def open_events(path: Union[str, Path], role: str) -> EventLog:
    """Open this process's event stream (closing any earlier one); :func:`emit` writes to it from now on."""
    global _current
    if _current is not None:
        _current.close()
    _current = EventLog(path, role)
    return _current


def set_peer(peer_id: str) -> None:
    """Name this process's peer in the events to come (once its DHT has started)."""
    current = _current
    if current is not None:
        current.peer = peer_id


def emit(event: str, **fields: Any) -> None:
    """Append one event to this process's stream, if one is open (see the module docstring for the events); safe
    while another thread closes it."""
    current = _current
    if current is not None:
        current.emit(event, **fields)


def close_events() -> None:
    """End this process's stream: what is emitted from now on, from any thread, is dropped."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.close()


@contextlib.contextmanager
def peer_events(path: Union[str, Path], role: str) -> Iterator[dict]:
    """This process's stream for the length of a peer's run, ended by its ``shutdown`` event: the block fills the
    dict it gets with the event's ``reason`` and ``epoch``; an exception ends it with ``reason="error"``."""
    open_events(path, role)
    ending: dict = {}
    try:
        yield ending
    except BaseException as error:
        emit("shutdown", reason="error", epoch=ending.get("epoch"), clean=False,
             error=f"{type(error).__name__}: {error}")
        raise
    else:
        emit("shutdown", clean=True, **ending)
    finally:
        close_events()


def epoch_causes(events: Iterable[dict]) -> List[Optional[str]]:
    """How a trainer reached each epoch of its ``epoch`` events (its events, oldest first): ``"step"`` (a step of its
    own ended the epoch before; ``ended_by``), else ``"label"`` (it took its group's label) or ``"download"`` (the
    swarm's state, after joining); None where the events do not say. One ``epoch`` event may cover a label taken and
    the step right after it: that is a step."""
    causes: List[Optional[str]] = []
    jump: Optional[str] = None
    for event in events:
        if event["event"] == "label_taken":
            jump = "label"
        elif event["event"] == "state_downloaded" and event.get("reason") != "join":
            jump = "download"
        elif event["event"] == "epoch":
            causes.append("step" if event.get("ended_by") is not None else jump)
            jump = None
    return causes


def read_events(path: Union[str, Path], event: Optional[str] = None) -> List[dict]:
    """The events in ``path`` (all, or only those named ``event``), oldest first; a missing file has none. A last line
    still being written is left out."""
    return list(EventReader(path).new(event))


class EventReader:
    """Reads a stream as it grows: each :meth:`new` returns the complete lines appended since the last call."""

    def __init__(self, path: Union[str, Path]):
        self.path, self._offset = Path(path), 0

    def new(self, event: Optional[str] = None) -> Iterator[dict]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return iter(())
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = (json.loads(line) for line in complete.splitlines() if line.strip())
        return iter([record for record in records if event is None or record["event"] == event])
