"""Swarm-wide agreement on the settings that must be equal across a run.

Peers of one run must agree on the model, the tokenizer, the task, the optimizer and its schedule, the target batch
and the compressions: a peer that differs either cannot load the others' state (hivemind would retry forever) or
silently averages incompatible updates. The application passes those settings as a flat mapping (name -> value, the
names being the flags a user would change); every peer publishes them with their digest under ``{run_id}_agreement``
(a subkey owned by its RSA key, like its metrics), and compares them with the records of the others.

The swarm's settings are those of its oldest live peer: a peer whose settings differ from the oldest peer's stops
with one line naming the first field that differs and both values (:class:`SettingsMismatchError`), while the older
peers go on. Only the oldest peer counts: a misconfigured newcomer's record outlives its refusal by up to ``ttl``
seconds, and must not refuse the newcomers after it (seen in ``tests/test_agreement.py``: of five misconfigured
newcomers started at once, one was refused for another's setting). Records live ``ttl`` seconds and are renewed every ``period`` seconds, so the settings of a swarm that
has emptied out do not bind a new one for long. Malformed records are ignored.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any, Mapping, Optional

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, ValidationError

from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)


class SettingsMismatchError(ValueError):
    """This peer's settings differ from those of an older peer of the same run: ``differences`` maps each setting
    that differs to [ours, theirs] (``None`` where a peer has none)."""

    def __init__(self, message: str, differences: Optional[dict[str, list]] = None):
        super().__init__(message)
        self.differences = differences or {}


class AgreementRecord(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    digest: str
    since: float  # when the peer first published (its start); the oldest live peer's settings are the swarm's
    settings: dict[str, str]  # name -> the value as JSON


def agreement_key(run_id: str) -> str:
    return f"{run_id}_agreement"


def settings_digest(settings: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()


def first_difference(ours: Mapping[str, str], theirs: Mapping[str, str]) -> Optional[str]:
    """The first setting (in name order) whose values differ, or None."""
    return next((name for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)), None)


def swarm_mismatch(ours: AgreementRecord, others: list) -> Optional[SettingsMismatchError]:
    """The error for a peer with record ``ours``, if the oldest valid record among ``others`` (raw DHT values) is
    older and has other settings. Only the oldest counts: a misconfigured newcomer, refused but still listed for a
    while, must not refuse the peers that come after it."""
    valid = []
    for value in others:
        try:
            other = AgreementRecord.model_validate(value)
        except ValidationError:
            continue
        if other.digest == settings_digest(other.settings):  # else a forged or corrupt record
            valid.append(other)
    if not valid:
        return None
    oldest = min(valid, key=lambda record: (record.since, record.digest))
    if oldest.digest == ours.digest or (oldest.since, oldest.digest) >= (ours.since, ours.digest):
        return None
    name = first_difference(ours.settings, oldest.settings)
    started = time.strftime("%H:%M:%S", time.localtime(oldest.since))
    differences = {key: [_decoded(ours.settings.get(key)), _decoded(oldest.settings.get(key))]
                   for key in sorted(set(ours.settings) | set(oldest.settings))
                   if ours.settings.get(key) != oldest.settings.get(key)}
    return SettingsMismatchError(
        f"--{name}: this peer has {ours.settings.get(name, 'nothing')}, the swarm has "
        f"{oldest.settings.get(name, 'nothing')} (a peer running since {started}); every peer of a run must use the "
        f"same value", differences)


def _decoded(value: Optional[str]) -> Any:
    try:
        return None if value is None else json.loads(value)
    except ValueError:  # a record is validated as strings, not as JSON
        return value


class SwarmAgreement:
    """Publishes this peer's settings and watches the others' in a background thread (every ``period`` s).

    :param settings: name -> value (any JSON-serializable value); names should be the flags that set them
    :param public_key: this peer's signature validator key (it owns the record's subkey)
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, public_key: bytes, settings: Mapping[str, Any],
                 period: float = 10.0, ttl: float = 60.0):
        self.dht, self.key, self.public_key, self.period, self.ttl = dht, agreement_key(run_id), public_key, period, ttl
        self.settings = {name: json.dumps(value, sort_keys=True) for name, value in settings.items()}
        self.record = AgreementRecord(digest=settings_digest(self.settings), since=get_dht_time(),
                                      settings=self.settings)
        self.mismatch: Optional[SettingsMismatchError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="swarm-agreement", daemon=True)

    def start(self) -> "SwarmAgreement":
        """Publish, compare with the peers already there (raising SettingsMismatchError), then keep watching."""
        logger.info(f"Comparing this peer's {len(self.settings)} run settings with the swarm's")
        self.publish()
        self.check()
        self._thread.start()
        return self

    def publish(self) -> None:
        self.dht.store(self.key, subkey=self.public_key, value=self.record.model_dump(),
                       expiration_time=get_dht_time() + self.ttl, return_future=True)

    def check(self) -> None:
        """Raise SettingsMismatchError if the oldest live peer of the run is older than this one and has other
        settings."""
        entry = self.dht.get(self.key, latest=True)
        records = entry.value if entry is not None and isinstance(entry.value, dict) else {}
        others = [item.value for owner, item in records.items() if owner != self.public_key and hasattr(item, "value")]
        mismatch = swarm_mismatch(self.record, others)
        if mismatch is not None:
            emit("settings_mismatch", differences=mismatch.differences)
            raise mismatch

    def raise_if_mismatched(self) -> None:
        if self.mismatch is not None:
            raise self.mismatch

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.publish()
                self.check()
            except SettingsMismatchError as error:
                self.mismatch = error
                return
            except Exception as error:  # a DHT hiccup: try again at the next period
                logger.debug(f"Could not compare settings with the swarm: {error!r}")
