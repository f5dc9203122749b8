"""lean_transformer.swarm.hivemind_fixes.declaration_stores: matchmaking waits for no DHT store of a declaration.

hivemind's own ``PotentialLeaders`` runs a search that declares this averager under its group key: a leader's group
closes when its declared time comes (hivemind declares again, which ends ``pop_next_leader``), and leaving the search
withdraws the declaration, as ``look_for_group`` does once its group formed. The DHT here takes ``STORE_SECONDS`` to
store a withdrawal, or ``SLOW_DECLARATION`` (longer than the declared time) a declaration, as a DHT in a busy swarm
over slow links does (2-78 s in benchmarks/internet.py).
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from lean_transformer.swarm.hivemind_fixes import declaration_stores

STORE_SECONDS, SLOW_DECLARATION, DECLARED = 2.0, 3.0, 1.0
PEER = PeerID(b"averager")


class SlowStores:
    """A DHT whose stores of a withdrawal (value False) take ``STORE_SECONDS``, and of a declaration
    ``declaration_seconds``; it holds no records."""

    def __init__(self, declaration_seconds: float = 0.0):
        self.stored: list = []  # (value, expiration time, when the store ended)
        self.declaration_seconds = declaration_seconds

    async def store(self, key, subkey, value, expiration_time, return_future=True) -> bool:
        await asyncio.sleep(self.declaration_seconds if value else STORE_SECONDS)
        self.stored.append((value, expiration_time, time.monotonic()))
        return True

    async def get(self, key, latest=True, return_future=True) -> None:
        return None


def key_manager(dht: SlowStores) -> GroupKeyManager:
    keys = GroupKeyManager.__new__(GroupKeyManager)
    keys.dht, keys.prefix, keys.group_bits, keys.peer_id, keys.target_group_size = dht, "fix", "", PEER, 2
    return keys


async def search_then_leave() -> tuple[float, float, list]:
    """Declare, leave the search; (seconds the leave took, the declared expiration, the DHT's stores)."""
    keys = key_manager(SlowStores())
    leaders = PotentialLeaders(PEER, min_matchmaking_time=1.0, target_group_size=2)
    step = SimpleNamespace(scheduled_time=get_dht_time() + 1.0, deadline=get_dht_time() + 30)  # what a search reads
    async with leaders.begin_search(step, keys, declare=True):
        await asyncio.wait_for(leaders.declared_expiration.wait(), 10)
        while not keys.dht.stored:  # the declaration is stored
            await asyncio.sleep(0.01)
        declared = leaders.declared_expiration_time
        leaving = time.monotonic()
    left = time.monotonic() - leaving
    await asyncio.wait_for(asyncio.gather(*declaration_stores._stores), STORE_SECONDS + 10)  # the withdrawal ends
    return left, declared, [(value, expiration, at - leaving) for value, expiration, at in keys.dht.stored]


def test_leaving_a_search_does_not_wait_for_the_withdrawal_to_be_stored(monkeypatch):
    # the control: hivemind's leave waits for the withdrawal's store
    monkeypatch.setattr(GroupKeyManager, "declare_averager", declaration_stores.HIVEMIND_DECLARE_AVERAGER)
    left, declared, stored = asyncio.run(search_then_leave())
    assert left >= STORE_SECONDS, left
    assert [(value, expiration) for value, expiration, _ in stored] == [
        (True, declared), (False, float(np.nextafter(declared, float("inf"))))]
    # the fix: the leave returns at once, and the same withdrawal is stored in the background
    monkeypatch.setattr(GroupKeyManager, "declare_averager", declaration_stores.declare_averager)
    left, declared, stored = asyncio.run(search_then_leave())
    assert left < STORE_SECONDS / 4, left
    assert [(value, expiration) for value, expiration, _ in stored] == [
        (True, declared), (False, float(np.nextafter(declared, float("inf"))))]
    assert stored[1][2] >= STORE_SECONDS and not declaration_stores._stores


async def time_to_close() -> float:
    """Declare for DECLARED s with stores of SLOW_DECLARATION s; the seconds until the search declares again, which
    is when hivemind's leader closes its group (``pop_next_leader`` raises and the leader assembles what it has)."""
    leaders = PotentialLeaders(PEER, min_matchmaking_time=DECLARED, target_group_size=2)
    step = SimpleNamespace(scheduled_time=get_dht_time() + DECLARED, deadline=get_dht_time() + 30)
    async with leaders.begin_search(step, key_manager(SlowStores(SLOW_DECLARATION)), declare=True):
        await asyncio.wait_for(leaders.declared_expiration.wait(), 10)
        declared, began = leaders.declared_expiration_time, time.monotonic()
        leaders.declared_expiration.clear()
        await asyncio.wait_for(leaders.declared_expiration.wait(), 10)
        assert leaders.declared_expiration_time > declared
        return time.monotonic() - began


def test_a_leader_closes_its_group_at_its_declared_time_while_its_declaration_is_still_being_stored(
        monkeypatch, report):
    monkeypatch.setattr(GroupKeyManager, "declare_averager", declaration_stores.HIVEMIND_DECLARE_AVERAGER)
    hivemind = asyncio.run(time_to_close())
    assert hivemind >= SLOW_DECLARATION, hivemind  # the control: the close waits for the store
    monkeypatch.setattr(GroupKeyManager, "declare_averager", declaration_stores.declare_averager)
    ours = asyncio.run(time_to_close())
    assert DECLARED - 0.1 <= ours < DECLARED + 0.5, ours
    report(f"declared for {DECLARED:g} s, its store taking {SLOW_DECLARATION:g} s: the group closes after "
           f"{hivemind:.2f} s (hivemind), {ours:.2f} s (ours)")


def test_a_failed_store_is_one_debug_line_and_the_fix_is_installed(caplog):
    async def failing() -> bool:
        raise ConnectionError("the DHT is gone")

    with caplog.at_level("DEBUG", logger=declaration_stores.__name__):
        asyncio.run(declaration_stores._store(failing(), "fix.0b", looking_for_group=False))
    assert [record.levelname for record in caplog.records] == ["DEBUG"], caplog.text
    assert "Could not store this averager's withdrawal from fix.0b" in caplog.text
    # importing the package (above, for declaration_stores) installs its global fixes
    assert GroupKeyManager.declare_averager is declaration_stores.declare_averager
