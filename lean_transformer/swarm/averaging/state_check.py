"""A downloaded state's loss on a local batch against this peer's own, before the peer adopts it (issue 24).

Why: a newcomer, and a peer that fell out of sync, replace their whole state with a donor's. The download's checks
(:mod:`lean_transformer.swarm.hivemind_fixes.state_download`) catch a state of the wrong layout or with non-finite
values, but a well-formed wrong state passes them, and a peer that adopts it is ruined: in ``benchmarks/byzantine.py``
(gradient averaging, 1 liar of 4) the liar's own state went uphill (loss 5.6 -> 6.5), and each run in which an honest
trainer downloaded it ended 8-37% worse than the honest-only swarm, while runs without such a download ended within
1%. Robust aggregation cannot help there: a download is one peer's word, with no group to outvote it.

The rule: with the candidate's parameters in the model, the loss on one local batch (this peer's data, drawn for
this download and unknown to the donor) must not exceed this peer's own by more than :data:`MARGIN` of it. "Own" is
what the peer would otherwise train from: its parameters in gradient-averaging mode, its anchor in DiLoCo mode (and
the candidate's anchor is what is scored there, since a newcomer restarts from it). An honest donor is ahead of a
peer that fell behind, so it scores better, or within noise of the same batch; a peer whose own loss is not finite
accepts any finite score. Why 5% and not more: the whole of the tiny model's training in the benchmark spans 16% of
its loss (5.6 -> 4.7), and with a 10% margin a newcomer that had joined from a liar's early state (5.6) then took its
epoch-4 state too (6.26). A refused donor is skipped by this peer's downloads for :data:`REFUSE_FOR` seconds and the
next one is tried (``state_rejected`` event), so a peer that keeps falling out of sync does not fetch the same lie
every epoch. For as long, the refused donor's progress records are left out of this peer's view of the swarm's
progress (:class:`IgnoresRefusedDonors`): hivemind takes the swarm's epoch as the highest any peer reports, so a liar
that steps alone (or says it does) sets an epoch no honest donor can bring this peer to, and this peer would find
itself out of sync and download again at every step (seen in ``byzantine.py``'s gradient sign-flip cell: the liar
alone at epoch 75, the honest trainers at 2 downloading each other's states several times a second).

One exception: a DiLoCo peer whose group converged on a state with fewer outer steps than its own (it stepped
alone, or its round succeeded where the others' failed) held that state itself a few steps ago, and the group's is
worse on a batch by what its own steps since achieved. It also accepts a candidate whose anchor lies within a
distance its own steps since bound (``within``, see ``SwarmOptimizer._download_if_behind``).

The aux peer checks the states it checkpoints the same way, against its last snapshot, on its first held-out batch
(``--eval_batches``; public, so a liar could fit its state to it: a weaker check than a trainer's).

What it costs: two forward passes of one micro-batch (own, candidate), plus one per further candidate, and two more
on a second batch for a candidate that fails on the first (it is refused only if it fails on both), under
``torch.no_grad``, and a host copy of the model's weights while they run. The candidate's weights are copied into the
model's own tensors and the model's are copied back bit for bit, so it needs no GPU memory beyond an evaluation
forward pass. What it does not catch: a state crafted to score well on any batch this peer might draw but wrong
elsewhere (a targeted backdoor), or a donor slightly worse than :data:`MARGIN` allows (``docs/security.md``).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Collection, Optional, Sequence, Union

import torch
from hivemind.p2p import PeerID
from torch import nn

logger = logging.getLogger(__name__)

MARGIN = 0.05  # a candidate may score at most this fraction of the own loss worse on the same local batch
REFUSE_FOR = 600.0  # seconds a refused donor is skipped by this peer's downloads (as long as an exclusion)


class StateCheck:
    """Scores candidate parameters on a local batch against this peer's own (see the module's docstring).

    ``model``: the trainer's model; ``parameters``: its parameters in the order of the swarm state's parameter tensors
    (the optimizer's parameter groups); ``loss``: a new local batch's loss function, called once per download, whose
    result (a closure) returns the model's loss on that batch as it is when called."""

    def __init__(self, model: nn.Module, parameters: Sequence[torch.Tensor],
                 loss: Callable[[], Callable[[], Union[torch.Tensor, float]]], margin: float = MARGIN):
        if not margin >= 0:
            raise ValueError(f"the state check's margin must be >= 0, got {margin}")
        self.model, self.parameters, self.loss, self.margin = model, list(parameters), loss, margin
        self._own: Optional[Sequence[torch.Tensor]] = None
        self._batch_loss: Optional[Callable[[], Union[torch.Tensor, float]]] = None
        self._own_loss = math.nan
        self._within: Optional[float] = None

    def begin(self, own: Optional[Sequence[torch.Tensor]] = None, within: Optional[float] = None) -> None:
        """Start a download: its candidates are scored against ``own`` (default: the model's parameters as they are
        then) on a new local batch, drawn when the first candidate arrives. ``within``: a candidate that scores
        worse passes all the same if its parameters lie within this L2 distance of the own (a DiLoCo peer ahead of
        the state its group converged on: see ``SwarmOptimizer._download_if_behind``)."""
        self._own, self._batch_loss, self._within = own, None, within

    @torch.no_grad()
    def problem(self, candidate: Sequence[torch.Tensor]) -> Optional[str]:
        """Why this peer should not adopt ``candidate`` (parameter tensors in :attr:`parameters` order); None if it
        scores no worse than the own state plus the margin, or if the own score is not finite."""
        if self._batch_loss is None:
            self._batch_loss = self.loss()
            self._own_loss = self._score(self._own)
        if len(candidate) != len(self.parameters):
            raise ValueError(f"{len(candidate)} candidate tensors for {len(self.parameters)} parameters")
        problem = self._verdict(self._score(candidate))
        if problem is None:
            return None
        if self._within is not None:
            distance = self._distance(candidate)
            if distance <= self._within:
                logger.info(f"A downloaded state passes though {problem}: it lies {distance:.4g} from this peer's "
                            f"own (at most {self._within:.4g})")
                return None
        # one batch's loss is noisy, and a flaky machine (bad memory, an fp16 overflow) can turn one forward pass
        # non-finite: a candidate that fails on the download's batch is scored again on a new one, and refused only
        # if it fails there too. Seen in tests/test_diloco_faults.py (CI): the peer whose forward passes turn NaN now
        # and then refused its group's honest state, first as 5.5% worse on one batch, then as NaN, and stayed out
        # of step with its group
        self._batch_loss = self.loss()
        self._own_loss = self._score(self._own)
        return self._verdict(self._score(candidate))

    def _verdict(self, score: float) -> Optional[str]:
        own = self._own_loss
        if not math.isfinite(score):
            return f"its loss on a local batch is {score}"
        if math.isfinite(own) and score > own + self.margin * abs(own):
            return (f"its loss on a local batch is {score:.4f} against {own:.4f} for this peer's own state "
                    f"(more than {self.margin:.0%} worse)")
        return None

    @torch.no_grad()
    def _distance(self, candidate: Sequence[torch.Tensor]) -> float:
        own = self.parameters if self._own is None else self._own
        return math.sqrt(sum(float((value.to(mine.device, torch.float32) - mine.float()).norm()) ** 2
                             for value, mine in zip(candidate, own)))

    @torch.no_grad()
    def _score(self, values: Optional[Sequence[torch.Tensor]]) -> float:
        """The local batch's loss with ``values`` in the model (None: as it is); the model is left as it was."""
        saved = None if values is None else [param.detach().to("cpu", copy=True) for param in self.parameters]
        training = self.model.training
        try:
            if values is not None:
                for param, value in zip(self.parameters, values):
                    param.copy_(value)
            self.model.eval()  # no dropout: both states are scored on the same function of the batch
            return float(self._batch_loss())
        finally:
            self.model.train(training)
            if saved is not None:
                for param, value in zip(self.parameters, saved):
                    param.copy_(value)


class IgnoresRefusedDonors:
    """Mixed in front of hivemind's ``ProgressTracker``: the progress records of the peers in ``refused()`` (peer IDs:
    donors whose states this peer's check refused, see the module's docstring) count neither toward the swarm's
    epoch nor its samples."""

    refused: Callable[[], Collection[str]] = staticmethod(lambda: ())  # set by the swarm optimizer

    def recount(self, records: Optional[dict] = None) -> None:
        """Recount the swarm's progress from ``records`` (read by the caller; by default the last records the
        tracker read), without the donors refused since (a fetch every few seconds would otherwise leave them in
        until then)."""
        metadata = getattr(self, "_last_metadata", None) if records is None else records
        if metadata is not None:
            with self.lock_global_progress:
                self.global_progress = self._parse_swarm_progress_data(metadata)

    def last_records(self) -> dict:
        """The swarm's progress records (subkey -> ``ValueWithExpiration``) as the tracker's fetches last read them:
        what the training thread may read without a lookup of its own. Some may have expired since (where lookups
        take most of a record's 60 s, many have): they still say who was there a moment ago."""
        metadata = getattr(self, "_last_metadata", None)
        return dict(metadata) if isinstance(metadata, dict) else {}

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        self._last_metadata = metadata
        refused = self.refused()
        if refused and isinstance(metadata, dict):
            metadata = {key: entry for key, entry in metadata.items() if record_reporter(entry) not in refused}
        return super()._parse_swarm_progress_data(metadata)


def record_reporter(entry: Any) -> Optional[str]:
    """The peer ID (text) of a progress record's reporter; None if the record does not say."""
    value = getattr(entry, "value", None)
    peer_id = value.get("peer_id") if isinstance(value, dict) else None
    try:
        return str(PeerID(peer_id)) if isinstance(peer_id, bytes) else None
    except Exception:  # malformed bytes: hivemind's own parsing decides about the record
        return None
