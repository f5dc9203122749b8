"""Shared by the tests that run whole swarms of peer processes: what the peers report in their events, and what a
DHT's routing table holds; and by those that run two bare P2P daemons."""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from lean_transformer.swarm.peers.processes import PeerExited, PeerProcess, wait_until


def listed_entry(dht, key: str, subkey: bytes):
    """``subkey``'s entry (a ValueWithExpiration) under the DHT's dictionary ``key``, as ``dht`` reads it now;
    None if there is none."""
    found = dht.get(key, latest=True)
    return found.value.get(subkey) if found is not None and isinstance(found.value, dict) else None


@contextlib.asynccontextmanager
async def p2p_pair() -> AsyncIterator[Tuple[Any, Any]]:
    """Two real P2P daemons on 127.0.0.1, the second bootstrapped from the first, shut down on exit."""
    from hivemind.p2p import P2P

    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await first.get_visible_maddrs())
    try:
        yield first, second
    finally:
        await second.shutdown()
        await first.shutdown()


async def routing_table_size(dht, node) -> int:
    """How many peers a DHT's routing table holds (``dht.run_coroutine(routing_table_size)``)."""
    return len(node.protocol.routing_table.uid_to_peer_id)


@dataclass(frozen=True)
class EpochReport:
    """What a trainer reported (and published as its metrics record) when it reached ``epoch``."""

    epoch: int
    mean_loss: float
    mini_steps: int
    samples: int
    skipped: int


def epoch_reports(peer: PeerProcess) -> Dict[int, EpochReport]:
    """The trainer's ``epoch`` events by epoch (a restarted trainer's stream may hold an epoch twice: the later one
    wins)."""
    return {event["epoch"]: EpochReport(event["epoch"], math.nan if event["loss"] is None else event["loss"],
                                        event["mini_steps"], event["samples"], event["skipped"])
            for event in peer.events("epoch")}


def untrained_loss(losses: Dict[str, Dict[int, float]]) -> float:
    """The swarm's first epoch loss (the untrained model's) from each trainer's mean loss by epoch. Not a trainer's
    own first one: a trainer that joins late downloads the trained state and reports from a later epoch on (CI: a
    trainer of test_robust_swarm started 20 s after the others and first reported epoch 6, at 5.0 against ~5.6)."""
    first_epoch = min(min(by_epoch) for by_epoch in losses.values())
    return max(by_epoch[first_epoch] for by_epoch in losses.values() if first_epoch in by_epoch)


def transitions(peer: PeerProcess) -> List[int]:
    """The epochs a peer moved to, in order."""
    return [event["epoch"] for event in peer.events("epoch")]


@dataclass(frozen=True)
class OpenRound:
    """An averaging round a peer has begun and not yet finished."""

    epoch: int  # the peer's epoch when the round began
    started: float  # the round_started event's time
    previous_end: float  # when the peer's previous round of this kind ended (0 if none did)


def open_round(events: List[dict], kind: str) -> Optional[OpenRound]:
    """The peer's open averaging round of ``kind``, from its events (oldest first), if any."""
    epoch, found, previous_end = None, None, 0.0
    for event in events:
        if event["event"] in ("joined", "epoch", "state_downloaded"):
            epoch = event["epoch"]
        elif event.get("kind") == kind:
            if event["event"] == "round_started":
                found = OpenRound(epoch, event["time"], previous_end)
            else:
                found, previous_end = None, event["time"]
    return found


def in_one_round(first: Optional[OpenRound], second: Optional[OpenRound]) -> bool:
    """Whether two peers' open rounds may be one round: both began after both peers' previous rounds ended. A peer
    still waiting for the results of a round that the other has already left is not in the other's new round (CI,
    tests/test_faults.py: the victim had averaged and begun its next round while steady was 0.2 s from its results
    of the round they had shared; the kill then landed in no round of steady's)."""
    return (first is not None and second is not None
            and max(first.previous_end, second.previous_end) < min(first.started, second.started))


def kill_during_round(peer: PeerProcess, partner: PeerProcess, kind: str, timeout: float,
                      min_epoch: int = 0) -> tuple[int, bool]:
    """SIGKILL ``peer`` as soon as it and ``partner`` are in one open averaging round of ``kind`` (see
    :func:`in_one_round`), ``peer``'s of epoch >= ``min_epoch``. Returns the lower of the two rounds' epochs and
    whether both rounds were still open right after the kill. The epochs may differ: peers whose local epoch labels
    are apart still average together (hivemind's group key has no epoch), and waiting for equal labels once took
    two minutes of rounds (seen in tests/test_faults.py, victim two labels ahead of its partner)."""
    def both_in_round() -> Optional[tuple[OpenRound, OpenRound]]:
        if peer.process.poll() is not None:
            raise PeerExited(f"{peer.name} exited before a {kind} round with {partner.name}:\n{peer.log_tail()}")
        mine, theirs = open_round(peer.events(), kind), open_round(partner.events(), kind)
        return (mine, theirs) if in_one_round(mine, theirs) and mine.epoch >= min_epoch else None

    mine, theirs = wait_until(both_in_round, timeout, f"{peer.name} and {partner.name} in a {kind} averaging "
                              f"round >= {min_epoch} together", interval=0.01)
    peer.kill()
    return (min(mine.epoch, theirs.epoch),
            open_round(peer.events(), kind) == mine and open_round(partner.events(), kind) == theirs)


def group_sizes(peer: PeerProcess, kind: str = "gradients") -> List[int]:
    """The size of every averaging group of ``kind`` that the peer averaged in, in order."""
    return [event["group_size"] for event in peer.events("averaged") if event["kind"] == kind]


def assert_shut_down(peer: PeerProcess, reason: str = "signal") -> None:
    """The peer's last run ended cleanly, for ``reason``."""
    shutdowns = peer.events("shutdown")
    assert shutdowns and (shutdowns[-1]["reason"], shutdowns[-1]["clean"]) == (reason, True), \
        (peer.name, shutdowns[-1:], peer.log_tail())


def unreadable_lines(log: str) -> List[str]:
    """What a healthy peer's log must not hold (issue 26 item 4): tracebacks, ERROR lines, and hivemind's
    progress-tracker lines ("accumulated N samples for epoch #E from P peers", up to two a second: our progress line
    says it)."""
    return [line for line in log.splitlines()
            if "Traceback" in line or "[ERROR]" in line or re.search(r"accumulated \d+ samples for epoch", line)]


def assert_readable_logs(peer: PeerProcess) -> None:
    log = peer.stderr + (peer.stdout if peer.stdout_path != peer.stderr_path else "")
    problems = unreadable_lines(log)
    assert not problems, f"{peer.name}'s log:\n" + "\n".join(problems[:20]) + f"\n...\n{peer.log_tail()}"


def epochs_after_outer_steps(peer: PeerProcess, group_size: int) -> set[int]:
    """The epochs a DiLoCo trainer reached right after an outer step with ``group_size`` peers (no state download
    in between)."""
    found, stepped = set(), False
    for event in peer.events():
        if event["event"] == "outer_step":
            stepped = event["group_size"] == group_size
        elif event["event"] == "state_downloaded":
            stepped = False
        elif event["event"] == "epoch" and stepped:
            found.add(event["epoch"])
            stepped = False
    return found
