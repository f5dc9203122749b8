"""The loss check of downloaded states (``swarm/averaging/state_check.py``): a candidate that scores worse than this
peer's own state by more than the margin on the same local batch is refused; the model is left exactly as it was;
a refused donor's progress records are left out of the swarm's progress."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration
from torch import nn

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.swarm.averaging.state_check import MARGIN, IgnoresRefusedDonors, StateCheck


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def assert_unchanged(model: nn.Module, before: list[torch.Tensor]) -> None:
    for param, saved in zip(model.parameters(), before):
        assert torch.equal(param, saved)


def patterned_batch() -> torch.Tensor:
    """Random tokens, each repeated once: a pattern a model learns in a few steps."""
    return torch.randint(61, (4, 8)).repeat_interleave(2, dim=1)


@pytest.fixture
def gpt(gpt_config) -> tuple[LeanGPTForCausalLM, StateCheck]:
    model = LeanGPTForCausalLM(gpt_config(hidden_dropout_prob=0.1))  # dropout: the check scores in eval mode
    batches = []

    def batch_loss():
        batch = patterned_batch()
        batches.append(batch)
        return lambda: model(input_ids=batch, labels=batch, return_logits=False).loss

    check = StateCheck(model, list(model.parameters()), batch_loss)
    check.batches = batches
    return model, check


def test_the_own_state_and_a_trained_one_pass_a_scaled_one_fails_and_the_model_is_untouched(gpt):
    model, check = gpt
    before = snapshot(model)
    check.begin()
    assert check.problem(before) is None  # the same state scores the same
    assert_unchanged(model, before)
    problem = check.problem([value * 10 for value in before])
    assert problem is not None and "loss on a local batch" in problem and "worse" in problem, problem
    assert_unchanged(model, before)
    assert model.training  # put back in training mode after scoring in eval mode
    assert len(check.batches) == 2  # one batch for the download, and a second that confirmed the refusal

    # a state trained on this peer's data distribution scores better than the untrained model
    trained = LeanGPTForCausalLM(model.config)
    trained.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-2)
    for _ in range(30):
        batch = patterned_batch()
        optimizer.zero_grad()
        trained(input_ids=batch, labels=batch, return_logits=False).loss.backward()
        optimizer.step()
    check.begin()
    assert check.problem(snapshot(trained)) is None
    assert_unchanged(model, before)


def test_non_finite_candidates_fail_and_a_broken_own_state_accepts_any_finite_one(gpt):
    model, check = gpt
    before = snapshot(model)
    check.begin()
    nan = [value.clone() for value in before]
    nan[0].view(-1)[0] = math.nan
    assert "nan" in check.problem(nan)
    broken = [torch.full_like(value, math.inf) for value in before]
    check.begin(own=broken)  # e.g. a peer whose parameters turned non-finite
    assert check.problem([value * 10 for value in before]) is None
    assert_unchanged(model, before)


def test_a_candidate_that_fails_on_one_batch_only_passes():
    """A forward pass that turns NaN once (a flaky machine) does not refuse a state: the candidate is scored again
    on a second batch, where it passes; a second batch is drawn only then."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    batches = []

    def batch_loss():
        flaky, forwards = not batches, []
        batches.append(flaky)

        def loss():
            forwards.append(1)
            value = model(torch.ones(1, 1)).pow(2).sum()
            return value * math.nan if flaky and len(forwards) == 2 else value  # the candidate's first forward

        return loss

    check = StateCheck(model, [model.weight], batch_loss)
    check.begin()
    assert check.problem([torch.full((1, 1), 2.0)]) is None
    assert batches == [True, False]
    assert check.problem([torch.full((1, 1), 2.0)]) is None and len(batches) == 2  # no third batch for a pass


def test_the_margin_is_relative_to_the_own_loss():
    """A linear model and a squared loss: the candidate w gives loss w^2 on input 1, target 0."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)  # own loss 4
    batch_loss = lambda: (lambda: model(torch.ones(1, 1)).pow(2).sum())  # noqa: E731
    check = StateCheck(model, [model.weight], batch_loss)
    check.begin()
    inside = math.sqrt(4 * (1 + MARGIN)) - 1e-3
    outside = math.sqrt(4 * (1 + MARGIN)) + 1e-3
    assert check.problem([torch.full((1, 1), inside)]) is None
    assert check.problem([torch.full((1, 1), outside)]) is not None
    check.begin(own=[torch.full((1, 1), -2.0)])  # scored against another own state than the model's: same loss
    assert check.problem([torch.full((1, 1), inside)]) is None
    assert model.weight.item() == 2.0
    with pytest.raises(ValueError, match="margin"):
        StateCheck(model, [model.weight], batch_loss, margin=-0.1)
    with pytest.raises(ValueError, match="2 candidate tensors for 1"):
        check.problem([torch.zeros(1, 1), torch.zeros(1, 1)])


def test_a_worse_candidate_within_the_allowed_distance_of_the_own_state_passes():
    """``within`` (a DiLoCo peer ahead of its group's state): a candidate scoring worse than the margin allows passes
    if it lies within that L2 distance of the own state, and only then; no second batch is drawn for it."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0, 2.0]]))  # own loss 4 on input (0, 1), target 0
    batches = []
    batch_loss = lambda: batches.append(1) or (lambda: model(torch.tensor([[0.0, 1.0]])).pow(2).sum())  # noqa: E731
    check = StateCheck(model, [model.weight], batch_loss)
    candidate = [torch.tensor([[0.0, 5.0]])]  # loss 25, 3 away
    for within, passes in ((None, False), (2.999, False), (3.0, True), (10.0, True)):
        batches.clear()
        check.begin(within=within)
        problem = check.problem(candidate)
        assert (problem is None) == passes, (within, problem)
        assert len(batches) == (1 if passes else 2), within
    check.begin(own=[torch.tensor([[0.0, 4.5]])], within=1.0)  # the distance from the own state given, not the model
    assert check.problem(candidate) is None
    assert model.weight.tolist() == [[0.0, 2.0]]


class Counted:
    """Stands in for hivemind's ProgressTracker: its count is the records it was given."""

    def __init__(self):
        self.lock_global_progress = threading.Lock()
        self.global_progress = None

    def _parse_swarm_progress_data(self, metadata):
        return sorted(metadata)


class Tracker(IgnoresRefusedDonors, Counted):
    pass


def test_the_progress_of_refused_donors_is_left_out_and_recounted_at_once():
    peers = [PeerID.from_base58(name) for name in (
        "QmNjVqTsjTF64F8WYFk4n6DWN8iFYCUYPWxN8uXQi1iXDZ", "QmTQcHT1GAAwJqdBKRVAWETfRmf6tWbbcQFPx8ifvFqq9J")]
    record = lambda peer_id: ValueWithExpiration(value=dict(peer_id=peer_id, epoch=1), expiration_time=0)  # noqa
    metadata = {"honest": record(peers[0].to_bytes()), "liar": record(peers[1].to_bytes()),
                "malformed": record(b"not a peer id"), "no id": ValueWithExpiration(None, 0)}
    tracker, refused = Tracker(), set()
    tracker.refused = lambda: refused
    assert tracker._parse_swarm_progress_data(metadata) == ["honest", "liar", "malformed", "no id"]
    refused.add(str(peers[1]))
    tracker.recount()  # from the records of the last fetch
    assert tracker.global_progress == ["honest", "malformed", "no id"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_model_scores_host_candidates_as_the_cpu_does_and_is_left_untouched(gpt_config):
    """Downloaded tensors arrive on the host while a trainer's model is on the GPU: the check copies them in and
    back, and scores them as the same check on the CPU does."""
    torch.manual_seed(0)
    cpu_model = LeanGPTForCausalLM(gpt_config())
    gpu_model = LeanGPTForCausalLM(gpt_config()).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    batch = patterned_batch()
    scaled = [param.detach().clone() * 10 for param in cpu_model.parameters()]  # host tensors, as downloaded
    verdicts = []
    for model in (cpu_model, gpu_model):
        device_batch = batch.to(next(model.parameters()).device)
        check = StateCheck(model, list(model.parameters()),
                           lambda model=model, device_batch=device_batch: lambda: model(
                               input_ids=device_batch, labels=device_batch, return_logits=False).loss)
        before = snapshot(model)
        check.begin()
        verdicts.append((check.problem(before), check.problem(scaled)))
        assert_unchanged(model, before)
        assert all(param.device == before[0].device for param in model.parameters())
    assert verdicts[0][0] is None and verdicts[1][0] is None
    assert verdicts[0][1] is not None and verdicts[1][1] is not None
    cpu_score, gpu_score = (float(verdict[1].split("is ")[1].split()[0]) for verdict in verdicts)
    assert gpu_score == pytest.approx(cpu_score, rel=1e-4)
