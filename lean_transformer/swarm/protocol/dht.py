"""Joining the swarm: building the hivemind DHT from the network arguments, with every bad input reported as one
clear exception (``ValueError`` for malformed arguments, ``SwarmConnectionError`` for peers that cannot be reached)
within a bounded time instead of a hang."""
from __future__ import annotations

import hashlib
import itertools
import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

import lean_transformer.swarm.hivemind_fixes  # noqa: F401  (installs the global fixes)
from lean_transformer.swarm.auth.authorizer import make_authorizer
from lean_transformer.swarm.auth.keys import load_identity_key
from lean_transformer.swarm.hivemind_fixes.dht_rejoin import keep_neighbours
from lean_transformer.swarm.hivemind_fixes.dht_shutdown import QuietShutdownDHT
from lean_transformer.swarm.hivemind_fixes.record_checks import RememberedChecks

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import NetworkSettings

logger = logging.getLogger(__name__)
_LOG_TIMESTAMP = re.compile(r"\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2} ")
_BOOTSTRAP_RETRY_DELAY = 2.0  # seconds between tries while no initial peer answers
# hivemind deems a DHT request lost after 3 s (``wait_timeout``): a bootstrap whose pings all go unanswered that long
# fails, and any peer that misses one request leaves the routing table. 3 s assumes a data centre: in
# benchmarks/internet.py (16 DiLoCo trainers + aux, 2 cores, 20-150 ms links) 14 of 20 trainers' first bootstraps
# failed so and were tried again, and a newcomer whose one live entry peer stayed that slow gave up after 90 s. A dead
# peer costs a request this long once per peer, before it leaves the table.
DHT_WAIT_TIMEOUT = 10.0


class SwarmConnectionError(RuntimeError):
    """The DHT could not start, or could not reach any of its initial peers in time."""


def build_dht(network: NetworkSettings, record_validators: Iterable[RecordValidatorBase] = ()) -> hivemind.DHT:
    """Start a DHT node as the network arguments say, or raise SwarmConnectionError within ``startup_timeout`` s.

    While none of ``initial_peers`` answers, it tries again until ``startup_timeout``: an organizer's entry peer that
    restarts, or is too busy to answer hivemind's first ping, should delay a volunteer, not turn it away
    (``benchmarks/internet.py`` saw 2 of 8 newcomers exit so). The p2p daemon, too, may take the whole
    ``startup_timeout`` to start (hivemind's limit is 15 s: on a busy machine a trainer of benchmarks/internet.py exited
    with "Daemon failed to start in 15.0 seconds"). A node that later loses every neighbour joins again
    through them (:mod:`~lean_transformer.swarm.hivemind_fixes.dht_rejoin`). Must be called from the main thread
    (hivemind starts a child process that owns the p2p daemon).
    """
    authorizer = make_authorizer(network.auth_token_path, network.authority_public_key_path, network.identity_path,
                                 network.run_id)
    deadline = time.monotonic() + network.startup_timeout
    for attempt in itertools.count():
        dht = QuietShutdownDHT(
            initial_peers=network.initial_peers,
            host_maddrs=network.host_maddrs,
            announce_maddrs=network.announce_maddrs or None,
            identity_path=network.identity_path,
            client_mode=network.client_mode,
            use_relay=network.use_relay,
            use_auto_relay=network.use_auto_relay,
            record_validators=[RememberedChecks(record_validators)],
            authorizer=authorizer,
            wait_timeout=DHT_WAIT_TIMEOUT,
            startup_timeout=max(deadline - time.monotonic(), 1.0),  # the p2p daemon's (hivemind.P2P.create)
            start=False,
        )
        try:
            dht.run_in_background(await_ready=True, timeout=max(deadline - time.monotonic(), 1.0))
            keep_neighbours(dht, network.initial_peers)
            return dht
        except TimeoutError:
            dht.terminate()
            dht.join(5)
            raise SwarmConnectionError(
                f"the DHT did not start within {network.startup_timeout:g} s (--startup_timeout); "
                f"are --initial_peers reachable from here?") from None
        except Exception as e:
            dht.join(5)
            reason = _LOG_TIMESTAMP.sub("", str(e)).strip() or type(e).__name__
            if "bootstrap" in reason and deadline - time.monotonic() > _BOOTSTRAP_RETRY_DELAY:
                if attempt == 0:
                    logger.warning(f"None of --initial_peers answered yet; trying again for up to "
                                   f"{network.startup_timeout:g} s (--startup_timeout)")
                time.sleep(_BOOTSTRAP_RETRY_DELAY)
                continue
            if "Daemon failed to start in" in reason:
                raise SwarmConnectionError(
                    f"the p2p daemon did not start within {network.startup_timeout:g} s (--startup_timeout); is "
                    f"this machine overloaded?") from None
            where = "reach --initial_peers" if network.initial_peers else "start the DHT"
            raise SwarmConnectionError(f"could not {where}: {reason}") from None


def peer_private_key(network: NetworkSettings) -> RSAPrivateKey:
    """The RSA key that owns this peer's signed DHT records (metrics, training progress). With --identity_path it is
    the identity's own key (created if missing), so a restarted peer keeps owning its records and an access token
    can be bound to it; otherwise hivemind's process-wide key."""
    if network.identity_path is None:
        return RSAPrivateKey.process_wide()
    return load_identity_key(network.identity_path, create=True)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def initial_peers_line(dht: hivemind.DHT) -> str:
    """The ready-to-paste argument that lets other peers join through this one."""
    return "--initial_peers " + " ".join(visible_maddrs(dht))


def derive_peer_seed(peer_id: PeerID, seed: int) -> int:
    """A 63-bit seed that differs between peers (so each shuffles its data differently) and is stable for a peer
    with a persistent identity."""
    digest = hashlib.sha256(peer_id.to_bytes() + seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TimedLookups:
    """``dht`` whose ``get`` notes how long each lookup took, from the call to the answer (``recent``: the last
    ``keep``, in seconds); everything else is ``dht``'s. Given to the progress tracker, whose fetches run every few
    seconds: the DHT's lookup time as this peer sees it, which sets how long a matchmaking declaration must live to be
    seen (:meth:`.SwarmOptimizer.matchmaking_window`)."""

    def __init__(self, dht: hivemind.DHT, keep: int = 5):
        self._dht = dht
        self.recent: deque[float] = deque(maxlen=keep)

    def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        started = time.perf_counter()
        future = self._dht.get(*args, return_future=True, **kwargs)
        future.add_done_callback(lambda _: self.recent.append(time.perf_counter() - started))
        return future if return_future else future.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)
