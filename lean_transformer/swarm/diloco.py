"""DiLoCo's outer loop: peers take many local optimizer steps, then average how far they moved and step together.

A round starts from shared parameters (the *anchor*). Each peer trains on its own for a while; its *pseudo-gradient*
is then ``anchor - parameters``. The swarm all-reduces the pseudo-gradients, weighted by the samples each peer
processed, and every peer applies the same outer step to the anchor: SGD with Nesterov momentum (DiLoCo's outer
optimizer), after which the parameters restart from the new anchor. Since every peer applies the same step to the
same anchor with the same momentum, the peers stay identical without exchanging parameters.

Built from kept parts: the outer step is ``torch.optim.SGD(nesterov=True)`` on the anchor tensors (their ``.grad``
set to the averaged pseudo-gradient), and the all-reduce is hivemind's ``DecentralizedAverager`` with the cancel
fixes of :mod:`lean_transformer.swarm.hivemind_fixes.averagers`. Only the bookkeeping between them is ours.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, NoCompression

from lean_transformer.swarm.hivemind_fixes.averagers import CancelSafe


class OuterNesterov:
    """The outer optimizer's state: float32 anchor copies of ``parameters`` and SGD-Nesterov momentum over them.

    ``pseudo_gradients()`` gives ``anchor - parameters`` (float32, fresh tensors); ``step(averaged)`` applies one outer
    step to the anchor with ``averaged`` as its gradient and copies the new anchor into the parameters.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], lr: float = 0.7, momentum: float = 0.9):
        self.parameters: List[torch.Tensor] = list(parameters)
        if not self.parameters:
            raise ValueError("parameters: OuterNesterov needs at least one tensor")
        if not lr > 0:
            raise ValueError(f"lr (--outer_lr) must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum (--outer_momentum) must be in [0, 1), got {momentum}")
        self.anchor = [param.detach().to(torch.float32, copy=True) for param in self.parameters]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def pseudo_gradients(self) -> List[torch.Tensor]:
        return [anchor - param.float() for anchor, param in zip(self.anchor, self.parameters)]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor]) -> None:
        if len(averaged) != len(self.anchor):
            raise ValueError(f"averaged: expected {len(self.anchor)} tensors, got {len(averaged)}")
        for anchor, delta in zip(self.anchor, averaged):
            if delta.shape != anchor.shape:
                raise ValueError(f"averaged: a tensor of shape {tuple(delta.shape)} for a parameter of shape "
                                 f"{tuple(anchor.shape)}")
            anchor.grad = delta.to(torch.float32)
        self.optimizer.step()
        for anchor, param in zip(self.anchor, self.parameters):
            anchor.grad = None
            param.copy_(anchor)

    def state_tensors(self) -> List[torch.Tensor]:
        """What a newcomer needs besides the inner optimizer: the anchor and the momentum (zeros before the first
        step), in parameter order."""
        momenta = [self.optimizer.state[anchor].get("momentum_buffer") for anchor in self.anchor]
        return self.anchor + [torch.zeros_like(a) if m is None else m for a, m in zip(self.anchor, momenta)]

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != 2 * len(self.anchor):
            raise ValueError(f"tensors: expected {2 * len(self.anchor)} (anchor + momentum), got {len(tensors)}")
        count = len(self.anchor)
        for anchor, param, source, momentum in zip(self.anchor, self.parameters, tensors[:count], tensors[count:]):
            anchor.copy_(source)
            param.copy_(anchor)
            self.optimizer.state[anchor]["momentum_buffer"] = momentum.to(torch.float32, copy=True)


class _Averager(CancelSafe, DecentralizedAverager):
    """hivemind's DecentralizedAverager, safe to cancel (same wire format)."""


class PseudoGradientAverager:
    """All-reduces pseudo-gradients with the peers under ``prefix``, weighted by samples, through hivemind.

    ``average(pseudo_gradients, samples)`` returns the swarm's weighted mean and the group size, or ``None`` when no
    group formed or the all-reduce failed within ``timeout`` (the caller keeps its progress for the next round).
    """

    def __init__(self, dht: hivemind.DHT, prefix: str, shapes: Sequence[torch.Size], *,
                 matchmaking_time: float = 5.0, allreduce_timeout: float = 60.0,
                 compression: CompressionBase = NoCompression(), **averager_opts):
        self.averager = _Averager([torch.zeros(shape) for shape in shapes], dht, start=True, prefix=prefix,
                                  min_matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout,
                                  compression=compression, **averager_opts)
        self.timeout = matchmaking_time + allreduce_timeout

    def average(self, pseudo_gradients: Sequence[torch.Tensor], samples: int) -> Optional[tuple]:
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        with self.averager.get_tensors() as buffers:
            for buffer, delta in zip(buffers, pseudo_gradients):
                buffer.copy_(delta)
        try:
            gathered = self.averager.step(weight=float(samples), timeout=self.timeout)
        except Exception:  # hivemind raises its own errors on a failed round; the round is simply missed
            return None
        if gathered is None:
            return None
        with self.averager.get_tensors() as buffers:
            return [buffer.clone() for buffer in buffers], len(gathered)

    def shutdown(self) -> None:
        self.averager.shutdown()


class DiLoCoRounds:
    """Counts a peer's inner steps and runs an outer round every ``local_steps`` of them.

    Call ``after_inner_step(samples)`` after each inner optimizer step. On the ``local_steps``-th it averages the
    pseudo-gradient (weighted by the samples since the anchor) and applies the outer step. A missed round (no group,
    a failed all-reduce) changes nothing: the anchor stays, so this peer's progress is folded into its next round's
    pseudo-gradient and weight. Returns the group size of a completed round, else None.
    """

    def __init__(self, outer: OuterNesterov, averager: PseudoGradientAverager, local_steps: int):
        if local_steps < 1:
            raise ValueError(f"local_steps (--local_steps) must be >= 1 for DiLoCo, got {local_steps}")
        self.outer, self.averager, self.local_steps = outer, averager, local_steps
        self.steps_since_round = self.samples_since_anchor = self.rounds = 0

    def after_inner_step(self, samples: int) -> Optional[int]:
        self.steps_since_round += 1
        self.samples_since_anchor += samples
        if self.steps_since_round < self.local_steps:
            return None
        self.steps_since_round = 0
        result = self.averager.average(self.outer.pseudo_gradients(), self.samples_since_anchor)
        if result is None:
            return None
        averaged, group_size = result
        self.outer.step(averaged)
        self.samples_since_anchor, self.rounds = 0, self.rounds + 1
        return group_size
