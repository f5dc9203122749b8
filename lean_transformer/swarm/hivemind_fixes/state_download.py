"""State downloads that cannot tear, be cut short unnoticed, or crash the peer that receives them.

What hivemind 1.1.12 does wrong (``DecentralizedAverager._load_state_from_peers`` and
``TrainingStateAverager.load_state_from_peers``/``get_current_state``):

- **A cut stream passes for a whole one.** Its p2p client ends a response stream quietly when the connection closes
  (``IncompleteReadError`` -> ``break``), and the downloader never compares the tensors it got with what the
  metadata announced. A server that goes away mid-download (a peer restarting its averager, dying, or a broken link)
  leaves the receiver with a truncated list: ``load_optimizer_state`` then raises ``IndexError``, which hivemind does
  not catch (it expects ``StopIteration``). That killed the aux peer of ``make demo`` while it downloaded a
  checkpoint from a trainer that was changing epoch.
- **Metadata leaks from one peer to the next.** The loop over peers keeps the previous peer's ``metadata`` when the
  next one fails or refuses, so one peer's metadata can be paired with another peer's tensors.
- **A served state can be torn.** ``get_current_state`` hands out the optimizer's own CPU tensors (``.cpu()`` does not
  copy) and streams them after releasing its lock, while the next optimizer step updates them in place.
- **A served state can be mislabelled.** ``TrainingStateAverager.step`` moves ``local_epoch`` on, then hands the
  optimizer step of that epoch to its one-thread executor, behind any delayed parameter round still running there. A
  state served in between pairs the new epoch with the old parameters: the project's CI saw an aux peer's checkpoint
  of epoch 11 hold epoch 10's parameters, and a newcomer would stay a step behind the swarm under the swarm's label.
- **A donor drops off the list at every re-declaration, and stays on it when it leaves.** A peer that shares its
  state stores its entry in the DHT
  with an expiration of ``declare_state_period`` and stores the next one only when that expires, so for the length
  of a DHT store (a few ms on loopback, seconds on a loaded or slow peer) the swarm has no donor. A newcomer that
  looks then joins without the swarm's state and trains on its own until its first step notices (seen once in CI: a
  late peer joined at its local epoch 1, the swarm being at 3). A donor that shuts down leaves its entry behind.
- **One failed hand-over stops a donor serving for good.** The host thread that hands a snapshot to the averager
  marks its future done, then pickles the tensors into shared memory; when that fails (torch's shared-memory manager
  timed out on a starved box, ``benchmarks/internet.py`` at 16 DiLoCo trainers), it sets an exception on the done
  future, which raises ``InvalidStateError`` out of the thread: the peer still declares itself a donor and never
  serves again, and every downloader that asks it waits out its timeout.
- **Nothing is validated.** A state of another shape (a peer with another ``--min_8bit_size``), dtype, or with NaN in
  it is loaded as is, or fails deep inside ``load_state_dict``; ``hivemind.Optimizer.load_state_from_peers`` then
  retries forever without saying why.

Here a donor's entry outlives its next re-declaration by one period, and a donor that leaves takes it off; the
server takes its snapshot under the optimizer's lock, never between an epoch's label and its step (it waits for the
step, within the downloader's patience), and sends copies with their count, put in shared memory before the
hand-over (one buffer per dtype; a failure there fails that download alone), and ends it with an explicit end
after which the receiver closes the stream first (:mod:`.stream_answers`: p2pd's close otherwise cut 1 to 4 in 100 of
4 MB streams at their tail, and the CI saw a newcomer join alone for it); the receiver tries peers in
hivemind's order, each with fresh metadata, and checks every state against its own layout (count, shapes, dtypes,
optimizer structure, finite values, epoch) before it touches the model or optimizer, then with the trainer's own
check of what the state's parameters are worth (``download_check``, see
:mod:`lean_transformer.swarm.averaging.state_check`; hivemind has none). A bad state is logged in one line and the
next peer is tried; no peer with a fitting state leaves the receiver where it was, within the
download's bound. Reproduced by ``tests/test_state_download.py`` (peers serving truncated, reshaped, NaN, wrongly
typed, oversized and foreign-structured states, a peer that steps while it serves, one asked for its state
while its epoch's step waits behind a parameter round, and one whose first hand-over fails) and
``tests/test_state_declaration.py`` (the gap and the leaving donor, against hivemind's own averager). Drop when
hivemind checks a downloaded state's length, ends a cut stream with an error, overlaps its declarations, unlists a
leaving donor, moves the epoch with its step and keeps serving after a failed hand-over (not fixed in 1.1.12, nor
in its master, checked 2026-11-29).

Ours, not a fix: a donor's entry may carry a label (:attr:`ValidatedStateSharing.state_label`), and among donors of
the same priority a downloader tries first those whose label the most donors share. A DiLoCo trainer labels its
entry with its outer state's fingerprint: after a round that split into groups, the swarm holds several outer
states at the same epoch, and a newcomer that downloaded a minority's (hivemind ties are random) lost its group's
next vote and downloaded again, with no earlier state kept to replay from (benchmarks/internet.py, 16 DiLoCo
trainers: 7 of the 9 failed catch-ups with no state kept followed a download from a donor drawn so). Older peers
skip a labelled entry as malformed: all peers of a run should run the same version.
"""
from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from lean_transformer.swarm.averaging.state_check import REFUSE_FOR
from lean_transformer.swarm.hivemind_fixes.store_outcomes import read_store_outcome
from lean_transformer.swarm.hivemind_fixes.stream_answers import UntilStateEnd
from lean_transformer.swarm.monitoring.events import emit
from lean_transformer.swarm.monitoring.transfer import TransferProgress

logger = get_logger(__name__)

MIN_CHUNK_TIMEOUT = 10.0  # seconds to wait for the next part of a state, whatever the (short) request timeout
UNLIST_TIMEOUT = 2.0  # seconds a leaving donor waits for the DHT to take it off the list
PROGRESS_EVERY = 5.0  # seconds between two progress lines of a state download (none for a shorter download)
MAX_CHECKED_DONORS = 3  # states one download scores with its check (each a whole download) before it keeps its own
MAX_LABEL_ITEMS = 4  # numbers in a donor's label (DiLoCo's outer-state fingerprint takes 2)


@dataclass(frozen=True)
class StateLayout:
    """What a state must look like to fit this peer: sent to the averager's process, which checks downloads."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    optimizer_skeleton: tuple[tuple[str, Any], ...]  # ("tensor", index) or ("value", type name) per element
    min_epoch: int

    def tensor_bytes(self, index: int) -> int:
        """Bytes of tensor ``index`` uncompressed."""
        return math.prod(self.shapes[index]) * torch.empty(0, dtype=self.dtypes[index]).element_size()

    def max_bytes(self, index: int) -> int:
        """The most bytes tensor ``index`` may take on the wire (uncompressed, plus room for a codec's header)."""
        return self.tensor_bytes(index) + 2**20

    def problem(self, metadata: Any, tensors: Sequence[torch.Tensor], any_epoch: bool = False) -> Optional[str]:
        """Why this downloaded state does not fit, in a few words; None if it does. ``any_epoch``: a state of any
        epoch (>= 0) fits, e.g. from the groupmates whose DiLoCo outer state this peer must take: their epoch labels
        may lag its own (labels count the swarm's epochs, not the outer steps the state holds), and refused for that,
        the download took the highest-epoch state on offer instead, once a liar's (benchmarks/byzantine.py)."""
        if not isinstance(metadata, dict):
            return f"metadata is a {type(metadata).__name__}, not a dict"
        epoch, min_epoch = metadata.get("epoch"), 0 if any_epoch else self.min_epoch
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < min_epoch:
            return f"epoch {epoch!r} is not an integer >= {min_epoch}"
        if metadata.get("num_tensors") != len(tensors):
            return f"the stream was cut: {len(tensors)} of {metadata.get('num_tensors')!r} tensors arrived"
        if len(tensors) != len(self.shapes):
            return f"{len(tensors)} tensors, this peer has {len(self.shapes)}"
        for index, (tensor, shape, dtype) in enumerate(zip(tensors, self.shapes, self.dtypes)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                return (f"tensor {index} is {tensor.dtype} {tuple(tensor.shape)}, this peer has "
                        f"{dtype} {shape}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"tensor {index} {shape} holds inf or nan"
        skeleton = optimizer_skeleton(metadata.get("optimizer_metadata"))
        if skeleton != self.optimizer_skeleton:
            return "the optimizer state has another structure (another optimizer or --min_8bit_size?)"
        for element in metadata["optimizer_metadata"]:
            value = element.get("value")
            if isinstance(value, float) and not math.isfinite(value):
                return f"the optimizer state holds the value {value}"
        return None


def shared_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in shared memory, as views of one buffer per dtype. Sharing each tensor on its own costs a
    round trip to torch's shared-memory manager per tensor, here and again in the averager's process that receives
    it (hivemind's ``file_system`` strategy), each of which a starved peer's manager can miss for its client's 1 s
    (benchmarks/internet.py: a donor whose hand-over held the optimizer's lock for 82 s); here it is one per dtype."""
    copies: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for dtype in dict.fromkeys(tensor.dtype for tensor in tensors):
        indices = [index for index, tensor in enumerate(tensors) if tensor.dtype == dtype]
        buffer = torch.empty(sum(tensors[index].numel() for index in indices), dtype=dtype).share_memory_()
        offset = 0
        for index in indices:
            size = tensors[index].numel()
            copies[index] = buffer[offset:offset + size].view(tensors[index].shape).copy_(tensors[index])
            offset += size
    return copies


def optimizer_skeleton(flat_metadata: Any) -> Optional[tuple[tuple[str, Any], ...]]:
    """The shape of ``dump_optimizer_state``'s metadata, with values reduced to their types; None if malformed."""
    if not isinstance(flat_metadata, list):
        return None
    skeleton = []
    for element in flat_metadata:
        if not isinstance(element, dict):
            return None
        if element.get("type") == "tensor":
            skeleton.append(("tensor", element.get("index")))
        elif element.get("type") == "value" and "value" in element:
            skeleton.append(("value", type(element["value"]).__name__))
        else:
            return None
    return tuple(skeleton)


def donor_entry(priority: float, label: Optional[tuple]) -> Any:
    """A donor's value in the DHT's list: hivemind's priority alone, or [priority, label] (see :func:`parse_entry`)."""
    return priority if label is None else [priority, list(label)]


def parse_entry(value: Any) -> Optional[tuple[float, Optional[tuple]]]:
    """(priority, label) of a donor's entry (a peer's message: anything), the label None if it has none; None if
    malformed. A label is a list of at most ``MAX_LABEL_ITEMS`` integers or finite floats."""
    def number(item: Any) -> bool:
        return isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item)

    if number(value):
        return float(value), None
    if isinstance(value, (list, tuple)) and len(value) == 2 and number(value[0]) and \
            isinstance(value[1], (list, tuple)) and len(value[1]) <= MAX_LABEL_ITEMS and all(map(number, value[1])):
        return float(value[0]), tuple(value[1])
    return None


def rank_donors(entries: dict, own: PeerID, donors: Sequence[str] = ()) -> list[PeerID]:
    """The peers of the DHT's donor list (subkey: peer ID bytes -> entry, :func:`parse_entry`) in the order to try
    them: ``donors`` (peer IDs) first, then by priority, then by how many donors declare the same label (the most
    first: in DiLoCo, the outer state most of the swarm holds), ties in random order; malformed entries and this
    peer left out (its own label counts for nothing either)."""
    parsed = {}
    for peer_id, info in entries.items():
        entry = parse_entry(info.value) if isinstance(info, ValueWithExpiration) else None
        if entry is None:
            continue
        try:
            parsed[PeerID(peer_id)] = entry
        except Exception:  # a malformed key in the DHT record
            continue
    parsed.pop(own, None)
    holders = Counter(label for _, label in parsed.values() if label is not None)
    ranked = {peer: (str(peer) in donors, priority, holders[label] if label is not None else 0, random.random())
              for peer, (priority, label) in parsed.items()}
    return sorted(ranked, key=ranked.get, reverse=True)


class ValidatedStateSharing:
    """Mixed in front of hivemind's ``TrainingStateAverager``: consistent snapshots out, validated states in.

    ``download_check`` (set by the swarm optimizer, :mod:`lean_transformer.swarm.averaging.state_check`): called once
    per download (with the download's ``within``), it returns a function of a fitting state's tensors that says why
    this peer should not adopt it (None: adopt). A refused donor is skipped for ``REFUSE_FOR`` seconds and the next
    one is tried.
    ``serve_gate`` (set by the swarm optimizer in DiLoCo mode): a snapshot waits for it for up to ``serve_wait``
    seconds (the swarm's setting, which a downloader adds to its wait for a donor's first part), then is taken
    anyway; the epoch's own gate (its optimizer step) is waited for within the downloader's patience, never passed.
    Both are checked under the optimizer's lock, so a gate cleared before a change that takes the lock keeps a
    snapshot either before the change or after the gate is set again."""

    download_check: Optional[Callable[[Optional[float]], Callable[[Sequence[torch.Tensor]], Optional[str]]]] = None
    serve_gate: Optional[threading.Event] = None
    _state_label: Optional[tuple] = None  # see state_label

    def __init__(self, *args: Any, serve_wait: float = 0.0, **kwargs: Any):
        self.serve_wait = serve_wait  # set before hivemind starts the averager's process, where downloads run
        self._epoch_stepped = threading.Event()  # clear from an epoch's label to the end of its optimizer step
        self._epoch_stepped.set()
        super().__init__(*args, **kwargs)

    def step(self, *, increment_epoch: bool = False, optimizer_step: bool = False, delay_optimizer_step: bool = False,
             **kwargs: Any) -> Any:
        """hivemind's step; one that moves the epoch on and steps the optimizer marks the state as unservable from
        the label's change (under the optimizer's lock, so no snapshot is in progress) to the step's end (in the
        background for a delayed step)."""
        options = dict(increment_epoch=increment_epoch, optimizer_step=optimizer_step,
                       delay_optimizer_step=delay_optimizer_step, **kwargs)
        if not (increment_epoch and optimizer_step):
            return super().step(**options)
        with self.lock_optimizer:
            self._epoch_stepped.clear()
        earlier = set(self.pending_updates)
        try:
            return super().step(**options)
        finally:
            in_background = set(self.pending_updates) - earlier if delay_optimizer_step else set()
            for update in in_background:
                update.add_done_callback(lambda _: self._epoch_stepped.set())
            if not in_background:
                self._epoch_stepped.set()

    @property
    def chunk_timeout(self) -> float:
        """Seconds a downloader waits for each part of a state (and a server for the step it must not serve within)."""
        return max(MIN_CHUNK_TIMEOUT, self.next_chunk_timeout or self.request_timeout)

    @property
    def state_label(self) -> Optional[tuple]:
        """What this peer's entry in the DHT's list of donors says of its state besides its priority (None: nothing):
        at most ``MAX_LABEL_ITEMS`` numbers, e.g. DiLoCo's outer-state fingerprint. Setting it re-declares the entry."""
        return self._state_label

    @state_label.setter
    def state_label(self, label: Optional[Sequence[float]]) -> None:
        label = None if label is None else tuple(label)
        if label is not None and parse_entry([0, label]) is None:
            raise ValueError(f"a donor's label is at most {MAX_LABEL_ITEMS} finite numbers, not {label!r}")
        if label != self._state_label:
            self._state_label = label
            self._outer_pipe.send(("_set_state_label", [label], {}))

    async def _set_state_label(self, label: Optional[tuple]) -> None:
        """Executed in the averager's process."""
        self._state_label = label
        self._state_updated.set()

    def _declare_as_donor(self, sharing: bool) -> MPFuture:
        """Store this peer's entry in the DHT's list of donors (``None`` takes it off), valid for two periods."""
        value = donor_entry(self.state_sharing_priority, self._state_label) if sharing else None
        return self.dht.store(f"{self._matchmaking.group_key_manager.prefix}.all_averagers",
                              subkey=self.peer_id.to_bytes(), value=value,
                              expiration_time=get_dht_time() + 2 * self.declare_state_period, return_future=True)

    async def _declare_for_download_periodically(self) -> None:
        """Executed in the averager's process: keep this peer on the DHT's list of donors with no gap, each entry
        valid for two periods and renewed every period (or at once when the priority or sharing changes)."""
        sharing_was_allowed = self.allow_state_sharing
        while True:
            if self.allow_state_sharing or sharing_was_allowed:  # a peer that stops sharing overwrites its entry
                store = self._declare_as_donor(self.allow_state_sharing)
                # a declaration that timed out (a DHT under load) is renewed at the next period: its outcome is read,
                # or asyncio logs it as an ERROR traceback (benchmarks/internet.py: 26 in one slow trainer's log)
                asyncio.create_task(asyncio.wait_for(store, timeout=self.declare_state_period)).add_done_callback(
                    read_store_outcome)
                sharing_was_allowed = self.allow_state_sharing
            self._state_updated.clear()
            try:
                await asyncio.wait_for(self._state_updated.wait(), timeout=self.declare_state_period)
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """Executed in the averager's process: a donor that leaves takes itself off the list first (within a bound),
        so that newcomers do not try it for the two periods its entry would live on."""
        if not self.client_mode and self.allow_state_sharing:
            try:
                await asyncio.wait_for(self._declare_as_donor(sharing=False), timeout=UNLIST_TIMEOUT)
            except Exception as error:  # the swarm forgets the entry when it expires
                logger.debug(f"Could not take this peer off the list of donors: {error!r}")
        await super()._shutdown(timeout)

    def get_current_state(self):
        """Executed in the host process for a peer that downloads our state: a snapshot between two optimizer steps,
        copied, so that streaming it cannot tear, with the tensor count that lets the receiver detect a cut."""
        gate_deadline = time.monotonic() + self.serve_wait
        patience = self.serve_wait + self.chunk_timeout  # the downloader's, for the first part
        deadline = time.monotonic() + patience
        while True:
            if self.serve_gate is not None:
                self.serve_gate.wait(max(0.0, gate_deadline - time.monotonic()))
            self._epoch_stepped.wait(max(0.0, deadline - time.monotonic()))
            with self.lock_optimizer:
                gate_open = self.serve_gate is None or self.serve_gate.is_set() or time.monotonic() >= gate_deadline
                if gate_open and self._epoch_stepped.is_set():
                    metadata, tensors, infos = super().get_current_state()
                    # in shared memory here, where a failure is an error for this download only (see the module
                    # docstring: hivemind's serving thread dies of one that happens as it hands the state over)
                    tensors = shared_copies(tensors)
                    break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"epoch {self.local_epoch}'s optimizer step did not end within {patience:g} s")
        metadata["num_tensors"] = len(tensors)
        return metadata, tensors, infos

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Executed in the averager's process: hivemind's, except that a snapshot this peer cannot take within the
        downloader's patience (:meth:`get_current_state`), or could not hand over (torch's shared memory), ends the
        stream with one line (the downloader tries the next donor). hivemind's RPC handler logged it as an ERROR
        traceback, which benchmarks/internet.py counts as a crash (one of 17 trainers)."""
        try:
            async for message in super().rpc_download_state(request, context):
                yield message
        except TimeoutError as error:
            logger.info(f"Did not serve this peer's state to {context.remote_id}: {error}")
        except RuntimeError as error:
            logger.warning(f"Did not serve this peer's state to {context.remote_id}: {error}")

    def _local_layout(self) -> StateLayout:
        with torch.no_grad(), self.lock_averaged_tensors:
            parameters = [param for group in self.optimizer.param_groups for param in group["params"]]
            optimizer_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
            tensors = list(chain(parameters, self.extra_tensors, optimizer_tensors))
            return StateLayout(tuple(tuple(tensor.shape) for tensor in tensors),
                               tuple(tensor.dtype for tensor in tensors), optimizer_skeleton(optimizer_metadata),
                               min_epoch=self.local_epoch)

    adopted_from: Optional[str] = None  # the donor (peer ID) of the last state this peer adopted
    adopted_count = 0  # states adopted so far

    def load_state_from_peers(self, timeout: Optional[float] = None, donors: Sequence[str] = (),
                              trusted: Sequence[str] = (), reason: str = "", within: Optional[float] = None,
                              **_unused) -> None:
        """Load the best state that a peer serves, that fits this peer (see the module's docstring) and that passes
        :attr:`download_check`; keep the current state if none does within ``timeout`` seconds (default:
        ``request_timeout`` per part). ``donors`` (peer IDs) are tried first, and their states fit at any epoch: e.g.
        DiLoCo's groupmates whose outer state the group converged on. The states of ``trusted`` peers skip
        :attr:`download_check` (the layout checks still apply): e.g. the donor a DiLoCo newcomer joined from, one
        outer step on (see ``SwarmOptimizer._trusted_donors``). ``within``: passed to :attr:`download_check` (a
        candidate whose parameters lie within this distance of the own passes it, see ``StateCheck.begin``).
        ``reason`` (why it downloads) goes into the ``state_downloaded`` event."""
        layout = self._local_layout()
        deadline = None if timeout is None else time.monotonic() + timeout
        check = None if self.download_check is None else self.download_check(within)
        refused = 0
        for attempt in range(MAX_CHECKED_DONORS if check is not None else 1):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            future = MPFuture()
            self._outer_pipe.send(("_download_fitting_state", [], dict(
                layout=layout, timeout=remaining, future=future, donors=tuple(map(str, donors)),
                skip=tuple(self.refused_donors()), first=attempt == 0)))
            loaded = future.result(timeout=None if remaining is None else remaining + MIN_CHUNK_TIMEOUT)
            if loaded is None:
                return
            metadata, tensors, source, seconds = loaded
            scored = check is not None and source not in trusted
            problem = check(tensors) if scored else None
            if problem is None:
                unscored = "" if scored or check is None else " (its last download's donor, a round on: not scored)"
                logger.info(f"Downloaded a state of epoch {metadata['epoch']} from {source} in {seconds:.3f} s"
                            f"{unscored}")
                emit("state_downloaded", epoch=metadata["epoch"], source=source, seconds=seconds, scored=scored,
                     reason=reason)
                self._adopt(metadata, tensors)
                self.adopted_from, self.adopted_count = source, self.adopted_count + 1
                return
            logger.warning(f"Rejected the state of {source}: {problem}; trying the next peer")
            emit("state_rejected", source=source, reason=problem)
            self.refuse_donor(source, REFUSE_FOR)
            refused += 1
        logger.warning(f"Kept this peer's own state: {refused} downloaded state(s) failed its check")

    def refuse_donor(self, peer_id: str, seconds: float) -> None:
        """Skip ``peer_id``'s states (and, through the progress trackers, its progress) for ``seconds`` from now,
        unless already for longer: a donor whose state failed the check, or a peer that this peer's averagers
        excluded for lying (:mod:`..averaging.exclusion`), which would otherwise still serve its state (and a liar
        stepping alone keeps the highest epoch)."""
        self._refused = getattr(self, "_refused", {})  # peer ID -> until when (time.monotonic()) it is refused
        self._refused[peer_id] = max(self._refused.get(peer_id, 0.0), time.monotonic() + seconds)

    def refused_donors(self) -> set[str]:
        """The peers (IDs) whose states this peer's check refused within the last ``REFUSE_FOR`` seconds, and those
        refused by :meth:`refuse_donor`."""
        now, refused = time.monotonic(), dict(getattr(self, "_refused", {}))  # a copy: the tracker's thread reads it
        return {peer for peer, until in refused.items() if until > now}

    def _adopt(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        parameters = [param for group in self.optimizer.param_groups for param in group["params"]]
        parameters_and_extras = list(chain(parameters, self.extra_tensors))
        with torch.no_grad(), self.lock_averaged_tensors:
            load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], tensors[len(parameters_and_extras):])
            for local, downloaded in zip(parameters_and_extras, tensors):
                local.copy_(downloaded, non_blocking=True)
        if self.offload_optimizer:
            self._apply_optimizer_parameters_()
        if not self.reuse_tensors:
            self._load_local_tensors_into_averager_()
        self.local_epoch = max(self.local_epoch, metadata["epoch"])  # a named donor's may be lower (StateLayout)
        self._update_scheduler()

    async def _download_fitting_state(self, layout: StateLayout, future: MPFuture, timeout: Optional[float] = None,
                                      donors: Sequence[str] = (), skip: Sequence[str] = (), first: bool = True
                                      ) -> None:
        """Executed in the averager's process: try the peers that share their state, ``donors`` first, then best
        first, none of ``skip``, until one serves a state that fits ``layout``; resolve ``future`` with (metadata,
        tensors, its peer ID, seconds) or None. ``first``: the first try of this download (it says how many share)."""
        chunk_timeout = self.chunk_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = self.dht.get(key, latest=True)
            ranked = [peer for peer in rank_donors(found.value if found is not None and isinstance(found.value, dict)
                                                   else {}, self.peer_id, donors) if str(peer) not in skip]
            if not ranked:
                logger.info("No peer shares its state" + (" (other than those refused)" if skip else "") +
                            ": this peer keeps its own")
            elif first:
                bound = "" if timeout is None else f", at most {timeout:g} s"
                logger.info(f"Downloading the swarm's state: {len(ranked)} peer(s) share one (best first{bound})")
            for peer in ranked:
                if deadline is not None and time.monotonic() > deadline:
                    logger.warning(f"No peer served a state that fits within {timeout:g} s")
                    break
                started = time.monotonic()
                try:
                    metadata, tensors = await self._download_state(peer, layout, chunk_timeout, deadline)
                    problem = None if metadata is None else layout.problem(metadata, tensors, str(peer) in donors)
                except ValueError as error:  # too large, or malformed on the wire
                    metadata, problem = {}, str(error)
                except Exception as error:
                    logger.warning(f"Could not download the state of {peer}: {type(error).__name__} {error}")
                    continue
                if metadata is None:
                    logger.debug(f"Peer {peer} does not share its state now")
                    continue
                if problem is not None:
                    logger.warning(f"Rejected the state of {peer}: {problem}; trying the next peer")
                    emit("state_rejected", source=str(peer), reason=problem)
                    continue
                future.set_result((metadata, tensors, str(peer), time.monotonic() - started))
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state(self, peer: PeerID, layout: StateLayout, chunk_timeout: float,
                              deadline: Optional[float]) -> tuple[Any, list[torch.Tensor]]:
        """One peer's whole response: (metadata, tensors), metadata None if it sent nothing. A response larger than
        ``layout`` allows is abandoned as it arrives (ValueError), so a peer cannot fill this peer's memory."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), chunk_timeout)  # dial
        metadata, tensors, parts, part_bytes = None, [], [], 0
        # progress in bytes of the uncompressed state: whole tensors received, plus the current one's bytes so far
        sizes = [layout.tensor_bytes(index) for index in range(len(layout.shapes))]
        progress, received_bytes = TransferProgress(f"Downloading the state of {peer}", sum(sizes), PROGRESS_EVERY), 0
        answers = UntilStateEnd(stream)
        try:
            while True:
                wait = chunk_timeout + (self.serve_wait if metadata is None and not tensors and not parts else 0.0)
                wait = wait if deadline is None else min(wait, max(0.0, deadline - time.monotonic()))
                try:
                    message = await asyncio.wait_for(answers.__anext__(), timeout=wait)
                except StopAsyncIteration:
                    break
                if message.metadata:
                    if metadata is not None:
                        raise ValueError("the stream carried metadata twice")
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a part with a dtype starts the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    received_bytes += sizes[len(tensors) - 1]
                    parts, part_bytes = [], 0
                if len(tensors) >= len(layout.shapes):
                    raise ValueError(f"it sends more than the {len(layout.shapes)} tensors of this peer's state")
                parts.append(message.tensor_part)
                part_bytes += len(message.tensor_part.buffer)
                if part_bytes > layout.max_bytes(len(tensors)):
                    raise ValueError(f"tensor {len(tensors)} is larger than this peer's {layout.shapes[len(tensors)]}")
                line = progress.update(received_bytes + min(part_bytes, sizes[len(tensors)]))
                if line is not None:
                    logger.info(line)
        finally:
            await answers.aclose()
        if not answers.whole and (metadata is not None or parts):  # its last tensor may lack parts: not counted
            total = metadata.get("num_tensors") if isinstance(metadata, dict) else None
            raise ValueError(f"the stream was cut: {len(tensors)} of {total!r} tensors arrived")
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return metadata, tensors
