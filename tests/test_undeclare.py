"""lean_transformer.swarm.hivemind_fixes.undeclare: leaving matchmaking does not wait for the DHT store of the
withdrawal.

hivemind's own ``PotentialLeaders`` runs a search that declares this averager under its group key, then leaves it,
as ``look_for_group`` does once its group formed; the group key's DHT answers the declaration at once and takes
``STORE_SECONDS`` to store the withdrawal, as a DHT in a busy swarm over slow links does (2-31 s in
benchmarks/internet.py).
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

from lean_transformer.swarm.hivemind_fixes import undeclare

STORE_SECONDS = 2.0
PEER = PeerID(b"averager")


class SlowStores:
    """A DHT whose stores of a withdrawal (value False) take ``STORE_SECONDS``; it holds no records."""

    def __init__(self):
        self.stored: list = []  # (value, expiration time, when the store ended)

    async def store(self, key, subkey, value, expiration_time, return_future=True) -> bool:
        await asyncio.sleep(0.0 if value else STORE_SECONDS)
        self.stored.append((value, expiration_time, time.monotonic()))
        return True

    async def get(self, key, latest=True, return_future=True) -> None:
        return None


async def search_then_leave() -> tuple[float, float, list]:
    """Declare, leave the search; (seconds the leave took, the declared expiration, the DHT's stores)."""
    keys = GroupKeyManager.__new__(GroupKeyManager)
    keys.dht, keys.prefix, keys.group_bits, keys.peer_id, keys.target_group_size = SlowStores(), "fix", "", PEER, 2
    leaders = PotentialLeaders(PEER, min_matchmaking_time=1.0, target_group_size=2)
    step = SimpleNamespace(scheduled_time=get_dht_time() + 1.0, deadline=get_dht_time() + 30)  # what a search reads
    async with leaders.begin_search(step, keys, declare=True):
        await asyncio.wait_for(leaders.declared_expiration.wait(), 10)
        while not keys.dht.stored:  # the declaration is stored
            await asyncio.sleep(0.01)
        declared = leaders.declared_expiration_time
        leaving = time.monotonic()
    left = time.monotonic() - leaving
    await asyncio.wait_for(asyncio.gather(*undeclare._stores), STORE_SECONDS + 10)  # the background withdrawal ends
    return left, declared, [(value, expiration, at - leaving) for value, expiration, at in keys.dht.stored]


def test_leaving_a_search_does_not_wait_for_the_withdrawal_to_be_stored(monkeypatch):
    # the control: hivemind's leave waits for the withdrawal's store
    monkeypatch.setattr(GroupKeyManager, "declare_averager", undeclare.HIVEMIND_DECLARE_AVERAGER)
    left, declared, stored = asyncio.run(search_then_leave())
    assert left >= STORE_SECONDS, left
    assert [(value, expiration) for value, expiration, _ in stored] == [
        (True, declared), (False, float(np.nextafter(declared, float("inf"))))]
    # the fix: the leave returns at once, and the same withdrawal is stored in the background
    monkeypatch.setattr(GroupKeyManager, "declare_averager", undeclare.declare_averager)
    left, declared, stored = asyncio.run(search_then_leave())
    assert left < STORE_SECONDS / 4, left
    assert [(value, expiration) for value, expiration, _ in stored] == [
        (True, declared), (False, float(np.nextafter(declared, float("inf"))))]
    assert stored[1][2] >= STORE_SECONDS and not undeclare._stores


def test_a_failed_withdrawal_is_one_debug_line_and_the_fix_is_installed(caplog):
    async def failing() -> bool:
        raise ConnectionError("the DHT is gone")

    with caplog.at_level("DEBUG", logger=undeclare.__name__):
        asyncio.run(undeclare._withdraw(failing(), "fix.0b"))
    assert [record.levelname for record in caplog.records] == ["DEBUG"], caplog.text
    assert "Could not withdraw this averager from fix.0b" in caplog.text
    # importing the package (above, for undeclare) installs its global fixes
    assert GroupKeyManager.declare_averager is undeclare.declare_averager
