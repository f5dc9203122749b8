"""A trainer that lies (issue 24; BTARD's attacks and a few more): ``run_trainer.py`` itself, except for one thing.
The gradient attacks replace its honest gradients right before each optimizer step, i.e. before hivemind accumulates
and averages them:

- ``sign_flip``: multiplied by ``-scale`` (1000);
- ``random_direction``: a fixed random direction (one per tensor, seeded) at ``scale`` times the tensor's gradient
  norm;
- ``alie`` ("a little is enough", Baruch et al. 2019): each coordinate moved ``z`` (1) standard deviations against
  its sign, the mean and deviation estimated from this peer's own recent gradients (exponential averages): a shift
  inside the honest spread, which no distance-based rule can tell from noise;
- ``stale``: the gradients of 20 local steps ago (a model that old), sent again;
- ``nan``: every gradient NaN (after the trainer's own non-finite check, as a patched peer would);
- ``inflate``: its honest gradients sign-flipped (x -1, not scaled), with ``inflate`` (10) x its samples claimed as
  its averaging weight (hivemind's ``GradientAverager.step``), so that the mean counts it 10 times.

In DiLoCo mode (``--local_steps``) the same attacks apply to the pseudo-gradient it sends to the outer all-reduce
(stale: the one of 3 rounds ago; inflate: 10x its samples as the round's weight), and its local steps stay honest.

``label_flip`` leaves the gradients alone and trains on wrong targets: every label shifted by one token id.

The reducer attacks train and send honestly and lie only in the answers they give as a reducer (the average of their
part of the all-reduce, to every other sender; its own copy stays honest), in gradient and DiLoCo (dense) mode:

- ``reducer_scale``: the average x ``scale`` (1000);
- ``reducer_flip``: the average x -1 (the honest magnitude);
- ``reducer_noise``: the average plus Gaussian noise of ``scale`` x its norm;
- ``reducer_swap``: the average of another part (the previous one it answered the same sender with; the first part
  honestly), tiled or cut to the part's size;
- ``reducer_zeros``: zeros.

All of them but ``nan`` are finite, so no non-finite guard catches them. Everything else (data, loss reports, progress)
is an honest trainer's, except that it excludes nobody: it stays in the honest trainers' groups as long as they let
it. Its own answer check, comparing honest answers with its lies (x -1000), would otherwise exclude every honest
reducer at once (a gross gap, answer_check.gross_problem) and take it out of their groups by itself.

With ``--start_file`` it imports everything, then waits (at most ``--start_timeout`` s) for that file before it
joins, so that a test can have it join at a chosen moment without the imports' delay.

Usage: python tests/lying_peer.py [--attack ATTACK] [--scale 1000] [--start_file F] [run_trainer.py arguments]
"""
import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer  # noqa: E402

GRADIENT_ATTACKS = ("sign_flip", "random_direction", "alie", "stale", "nan", "inflate")
REDUCER_ATTACKS = ("reducer_scale", "reducer_flip", "reducer_noise", "reducer_swap", "reducer_zeros")
ATTACKS = (*GRADIENT_ATTACKS, "label_flip", *REDUCER_ATTACKS)
ALIE_Z, ALIE_DECAY, STALE_STEPS, STALE_ROUNDS, INFLATE = 1.0, 0.9, 20, 3, 10.0


class Lies:
    """Replaces a list of honest tensors (gradients, or DiLoCo pseudo-gradients) in place by ``attack``'s."""

    def __init__(self, attack: str, scale: float, stale_steps: int):
        self.attack, self.scale = attack, scale
        self.directions, self.means, self.squares = {}, {}, {}
        self.history = collections.deque(maxlen=stale_steps + 1)

    @torch.no_grad()
    def __call__(self, tensors: list) -> None:
        if self.attack == "stale":
            self.history.append([tensor.clone() for tensor in tensors])
            for tensor, old in zip(tensors, self.history[0]):
                tensor.copy_(old)
        for index, tensor in enumerate(tensors):
            if self.attack == "sign_flip":
                tensor.mul_(-self.scale)
            elif self.attack == "inflate":
                tensor.neg_()
            elif self.attack == "nan":
                tensor.fill_(float("nan"))
            elif self.attack == "random_direction":
                if index not in self.directions:
                    generator = torch.Generator().manual_seed(index)
                    direction = torch.randn(tensor.shape, generator=generator)
                    self.directions[index] = direction / direction.norm()
                tensor.copy_(self.scale * tensor.norm() * self.directions[index])
            elif self.attack == "alie":
                mean = self.means.setdefault(index, tensor.clone())
                square = self.squares.setdefault(index, tensor.square())
                mean.mul_(ALIE_DECAY).add_(tensor, alpha=1 - ALIE_DECAY)
                square.mul_(ALIE_DECAY).addcmul_(tensor, tensor, value=1 - ALIE_DECAY)
                deviation = (square - mean.square()).clamp(min=0).sqrt()
                tensor.copy_(mean - ALIE_Z * deviation * mean.sign())


def lie_with_gradients(attack: str, scale: float) -> None:
    """Make every SwarmOptimizer of this process send ``attack``ed gradients (gradient averaging), or, in DiLoCo mode,
    ``attack``ed pseudo-gradients (its local steps stay honest; the lie is what it sends to the outer all-reduce)."""
    from lean_transformer.swarm.averaging.diloco import PseudoGradientAverager

    honest_step, honest_start = SwarmOptimizer.step, PseudoGradientAverager.start
    honest_prepare = PseudoGradientAverager.prepare
    gradient_lies, outer_lies = Lies(attack, scale, STALE_STEPS), Lies(attack, scale, STALE_ROUNDS)

    def lying_step(self, *args, **kwargs):
        if self.outer_loop is None:
            gradient_lies([param.grad for group in self.param_groups for param in group["params"]
                           if param.grad is not None])
        return honest_step(self, *args, **kwargs)

    def lying_start(self, pseudo_gradients, samples, tag=None, prepared=None):
        if pseudo_gradients is not None:
            pseudo_gradients = [delta.detach().clone() for delta in pseudo_gradients]
            outer_lies(pseudo_gradients)
            samples = INFLATE * samples if attack == "inflate" else samples
        return honest_start(self, pseudo_gradients, samples, tag, prepared=prepared)

    def lying_prepare(self, scheduled_time, samples, tag=None):  # a prepared round gathers its claim early
        return honest_prepare(self, scheduled_time, INFLATE * samples if attack == "inflate" else samples, tag)

    SwarmOptimizer.step, PseudoGradientAverager.start = lying_step, lying_start
    PseudoGradientAverager.prepare = lying_prepare
    if attack == "inflate":
        from hivemind.optim.grad_averager import GradientAverager

        honest_averager_step = GradientAverager.step

        def inflated_step(self, *args, weight=None, **kwargs):
            if weight is None:
                weight = INFLATE * self.local_samples_accumulated
            return honest_averager_step(self, *args, weight=weight, **kwargs)

        GradientAverager.step = inflated_step


def lying_average(attack: str, scale: float, average: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """What a reducer that lies with ``attack`` answers instead of ``average`` (``previous``: another part's)."""
    if attack == "reducer_scale":
        return average * scale
    if attack == "reducer_flip":
        return -average
    if attack == "reducer_noise":
        return average + scale * average.norm() * torch.randn_like(average) / max(average.numel(), 1) ** 0.5
    if attack == "reducer_swap":
        flat = previous.reshape(-1).repeat(average.numel() // max(previous.numel(), 1) + 1)[:average.numel()]
        return flat.view_as(average).clone()
    return torch.zeros_like(average)


def lie_as_reducer(attack: str, scale: float) -> None:
    """Make every all-reduce runner of this process (hivemind's, CenteredClip's, DiLoCo's same-result ones) answer
    other senders with ``attack``'s average. The answers are rewritten on their way out: the sender's parts are read
    as they stream in, and each answer (a delta, or DiLoCo's average itself) is decoded, lied about and encoded again
    with the sender's codec."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import averaging_pb2
    from lean_transformer.swarm.averaging.diloco import _SameResultRunner

    for runner_class in (AllReduceRunner, _SameResultRunner):
        honest = runner_class._accumulate_parts_streaming

        def lying_streaming(self, stream, sender_index, honest=honest):
            received = []

            async def recorded(messages):
                async for message in messages:
                    received.append(deserialize_torch_tensor(message.tensor_part))
                    yield message

            async def answers():
                averages = []
                async for message in honest(self, recorded(stream), sender_index):
                    if message.code != averaging_pb2.AVERAGED_PART:
                        yield message
                        continue
                    own = received[len(averages)]
                    answer = deserialize_torch_tensor(message.tensor_part)
                    average = own + answer if self.tensor_part_container.return_deltas else answer
                    previous = averages[-1] if averages else average
                    averages.append(average)
                    lie = lying_average(attack, scale, average, previous)
                    lie = lie - own if self.tensor_part_container.return_deltas else lie
                    serialized = serialize_torch_tensor(lie, message.tensor_part.compression)
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
            return answers()

        runner_class._accumulate_parts_streaming = lying_streaming


def lie_with_labels() -> None:
    """Shift every label of the causal LM by one token id (padding's -100 stays)."""
    from lean_transformer import LeanGPTForCausalLM

    honest_forward = LeanGPTForCausalLM.forward

    def lying_forward(self, *args, labels=None, **kwargs):
        if labels is not None:
            labels = torch.where(labels >= 0, (labels + 1) % self.config.vocab_size, labels)
        return honest_forward(self, *args, labels=labels, **kwargs)

    LeanGPTForCausalLM.forward = lying_forward


if __name__ == "__main__":
    own = argparse.ArgumentParser()
    own.add_argument("--attack", choices=ATTACKS, default="sign_flip")
    own.add_argument("--scale", type=float, default=1000.0)
    own.add_argument("--start_file")
    own.add_argument("--start_timeout", type=float, default=300.0)
    options, rest = own.parse_known_args()
    from lean_transformer.swarm.averaging.exclusion import Exclusions
    Exclusions.exclude = lambda self, peer_id, reason, why="": False  # it stays in every group it can join
    if options.attack == "label_flip":
        lie_with_labels()
    elif options.attack in REDUCER_ATTACKS:
        lie_as_reducer(options.attack, options.scale)
    else:
        lie_with_gradients(options.attack, options.scale)
    import run_trainer
    import transformers  # noqa: F401  (run_trainer's own imports, done before waiting)
    import lean_transformer.swarm.peers.trainer  # noqa: F401
    if options.start_file is not None:
        deadline = time.monotonic() + options.start_timeout
        while not Path(options.start_file).exists():
            if time.monotonic() > deadline:
                sys.exit(f"lying_peer.py: error: {options.start_file} did not appear within {options.start_timeout} s")
            time.sleep(0.05)
    sys.argv = [str(REPO / "run_trainer.py"), *rest]
    run_trainer.cli()
