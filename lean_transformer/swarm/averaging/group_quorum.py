"""A DiLoCo round's group that holds less than half of the swarm's trainers matches once more before it averages.

hivemind's matchmaking assembles a group when its leader's declared time comes, and the leader is the peer that
declared the earliest time: its own estimate of the round's end. Peers' estimates differ (each reads the swarm's
progress a DHT lookup late), and the earliest one decides when the group closes. benchmarks/internet.py, 16 DiLoCo
trainers, with hivemind's matchmaking logged at DEBUG: the slowest trainers' estimates of a round's end were 13-20 s
earlier than the others', so one of them led a group of 5 that closed 15 s before the round's end; the other 11,
which began matchmaking 15 s before their own (later) estimates, asked it 1-8 s after it had closed
(``NOT_LOOKING_FOR_GROUP``) and formed a group of their own. Two groups of one round apply different averages to one
anchor: the smaller group's members then went back and replayed the larger one's steps, or downloaded its state when
no history held the path (6 such downloads in that run). Most rounds of that run split this way.

Here every trainer gathers, with its round, how many trainers it sees in the swarm (its progress records). A group
whose trainers number less than half of the median of its members' counts is dissolved by every member alike (all
decide from the same gathered data) before its all-reduce, and hivemind's step matches again, now declared for one
matchmaking time, in which the later peers look for a group too. A group of exactly half is kept: in one run of that
benchmark a group of 8 of 16 dissolved, the other 8 had found no group either, and the round ended in groups of 5
and 2 and five misses; kept, the halves average apart and the next round's vote settles the anchor. A member that
matched once already in this round says so in what it gathers, and a group holding one is kept whatever its size: a
round matches at most twice, so a count that is too high (records of peers that left, which expire after a minute)
costs a round one matchmaking time, never the round. Groups without counts (aux peers gather none; older peers) are
kept. A peer's count is its message: the median resists one inflated count, and a false ``rematched`` only keeps a
group as hivemind would.

A re-match needs time, and its declaration must live as long as the DHT takes to show it. Each trainer also gathers
its matchmaking window (``SwarmOptimizer.matchmaking_window``: the matchmaking time, stretched by slow DHT lookups)
and its round's deadline. A minority group re-matches only if the earliest deadline leaves two of the members'
median window (one to match, one for the all-reduce and late members), and the retry declares itself for that
window, not for hivemind's ``min_matchmaking_time``. benchmarks/internet.py (16 DiLoCo trainers, matchmaking logged at
DEBUG, DHT lookups 11 s median): two groups of 5 of one round re-matched 70 s before their deadlines; the DHT lookup of
their retry took 47 s and found no one, the declaration's store 75 s, and all ten missed the round, where kept they
would have averaged as two groups. A false deadline or window only keeps a group (as hivemind would), and the median
resists one inflated window.

Hooked where hivemind offers no hook: its Matchmaking is built inside the averager's process, so its
``look_for_group`` is wrapped on the instance, once (as :class:`..exclusion.RefusesExcluded` wraps its requests).
hivemind logs the retry of a dissolved group as a WARNING; :class:`RematchRetries` makes it one INFO line.
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Optional, Sequence

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils import get_dht_time

from lean_transformer.swarm.averaging.round_events import gathered_data
from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)

AVERAGER_LOGGER = "hivemind.averaging.averager"  # where hivemind's _step logs "caught ..., retrying"


class Rematch(MatchmakingException):
    """Raised by every member of a group that holds too few of the swarm's trainers: hivemind's step retries."""


def minority(members: Sequence[Any], now: float) -> Optional[str]:
    """Why a group whose members gathered ``members`` (each a peer's message: a dict from a trainer, anything else
    from an aux peer or a malformed one) matches again at DHT time ``now``; None to keep it. Trainers' dicts carry
    ``samples``; their ``swarm`` is how many trainers each sees, ``rematched`` whether it matched once already in this
    round, ``window`` and ``deadline`` what :func:`retry_window` reads."""
    trainers = [member for member in members if isinstance(member, dict) and "samples" in member]
    if any(member.get("rematched") is True for member in trainers):
        return None
    counts = [count for count in (member.get("swarm") for member in trainers) if _number(count) and count > 0]
    if not counts:
        return None
    swarm = statistics.median(counts)
    if 2 * len(trainers) >= swarm:
        return None
    window = retry_window(trainers)
    deadlines = [deadline for deadline in (member.get("deadline") for member in trainers) if _number(deadline)]
    if window is not None and deadlines and min(deadlines) - now < 2 * window:
        logger.info(f"A group of {len(trainers)} of the swarm's {swarm:g} trainers, kept: {min(deadlines) - now:.0f} s "
                    f"left before its deadline, a re-match needs 2 x {window:.0f} s")
        return None
    return f"a group of {len(trainers)} of the swarm's {swarm:g} trainers: matching again for a larger one"


def retry_window(trainers: Sequence[dict]) -> Optional[float]:
    """The median of the matchmaking windows (seconds) that ``trainers`` gathered, None if none gathered one."""
    windows = [window for window in (member.get("window") for member in trainers) if _number(window) and window > 0]
    return statistics.median(windows) if windows else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RematchRetries(logging.Filter):
    """On hivemind's averager logger: the retry of a dissolved group (:class:`Rematch`) as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and f"caught {Rematch.__name__}(" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


class RematchesMinorityGroups:
    """Mixed in front of hivemind's DecentralizedAverager (in its process): a group that :func:`minority` finds too
    small for the swarm is dissolved before its all-reduce and this peer's step matches again (see the module)."""

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        self._wrap_look_for_group()
        await super()._step(step=step, **kwargs)

    def _wrap_look_for_group(self) -> None:
        matchmaking = self._matchmaking
        look_for_group = matchmaking.look_for_group
        if getattr(look_for_group, "rematches_minorities", False):
            return
        logger = logging.getLogger(AVERAGER_LOGGER)
        if not any(isinstance(existing, RematchRetries) for existing in logger.filters):
            logger.addFilter(RematchRetries())

        async def look_for_a_large_enough_group(step: StepControl) -> Optional[GroupInfo]:
            group = await look_for_group(step)
            if group is not None:
                self._dissolve_if_minority(group, step)
            return group

        look_for_a_large_enough_group.rematches_minorities = True
        matchmaking.look_for_group = look_for_a_large_enough_group

    def _dissolve_if_minority(self, group: GroupInfo, step: StepControl) -> None:
        members = [gathered_data(self.serializer, data) for data in group.gathered]
        now = get_dht_time()
        reason = minority(members, now)
        if reason is None:
            return
        window = retry_window([member for member in members if isinstance(member, dict)])
        if window is not None and now + window < step.deadline:  # hivemind's retry declares itself until
            step.scheduled_time = now + window  # max(scheduled time, now + min_matchmaking_time)
        bandwidth, mode, own = self.serializer.loads(step.data_for_gather)
        own = self.serializer.loads(own)
        if isinstance(own, dict):  # what this peer gathers when it matches again (hivemind's retry sends it)
            step._data_for_gather = self.serializer.dumps(
                [bandwidth, mode, self.serializer.dumps(dict(own, rematched=True))])
        emit("group_rematched", kind="outer", group_size=len(group.peer_ids), reason=reason)
        raise Rematch(reason)
