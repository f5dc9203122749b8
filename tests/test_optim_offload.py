"""OffloadedOptimizer: training a tiny LeanGPT with the optimizer (and float32 master weights) on the CPU."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.optim import CPULAMB8Bit, OffloadedOptimizer

# min_8bit_size below the tiny model's matrices (32x32 .. 61x32) so that they get 8-bit state
LAMB = functools.partial(CPULAMB8Bit, lr=0.03, weight_decay=0.01, min_8bit_size=512)


def batches(steps: int, vocab: int) -> list[torch.Tensor]:
    """Sequences of a repeating random pattern: learnable in a few dozen steps."""
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(vocab, (8,), generator=gen)
    return [pattern.repeat(4, 3)[:, torch.randint(8, (1,), generator=gen).item() :][:, :16] for _ in range(steps)]


def train(model: torch.nn.Module, optimizer, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for input_ids in data:
        loss = model(input_ids=input_ids.to(model.device), labels=input_ids.to(model.device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_offloaded_float32_model_trains_exactly_like_the_plain_optimizer(gpt_config):
    model = LeanGPTForCausalLM(gpt_config())
    twin = copy.deepcopy(model)
    data = batches(30, model.config.vocab_size)
    plain_losses = train(model, LAMB(model.parameters()), data)
    offloaded = OffloadedOptimizer(twin.parameters(), LAMB)
    offloaded_losses = train(twin, offloaded, data)
    assert plain_losses[-1] < 0.6 * plain_losses[0]
    assert offloaded_losses == plain_losses  # the same arithmetic on copies of the same numbers
    assert any(state["exp_avg"].dtype == torch.uint8 for state in offloaded.optimizer.state.values())
    for param, master in zip(twin.parameters(), offloaded.masters):
        assert master is not param and torch.equal(master, param)
        assert param.grad is None  # the gradients went to the host during backward


def test_offloaded_bfloat16_model_reaches_the_float32_loss(gpt_config):
    model = LeanGPTForCausalLM(gpt_config())
    low = copy.deepcopy(model).to(torch.bfloat16)
    data = batches(30, model.config.vocab_size)
    reference = train(model, LAMB(model.parameters()), data)
    offloaded = OffloadedOptimizer(low.parameters(), LAMB)
    losses = train(low, offloaded, data)
    assert abs(losses[-1] - reference[-1]) < 0.1 * reference[0]  # the same progress, up to bf16 rounding
    for param, master in zip(low.parameters(), offloaded.masters):
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(param, master.to(torch.bfloat16))  # the model holds the rounded master weights


def test_state_dict_round_trip(gpt_config):
    data = batches(12, 61)
    model = LeanGPTForCausalLM(gpt_config()).to(torch.bfloat16)
    initial = copy.deepcopy(model)
    offloaded = OffloadedOptimizer(model.parameters(), LAMB)
    train(model, offloaded, data[:6])
    saved = copy.deepcopy(offloaded.state_dict())
    expected = train(model, offloaded, data[6:])

    restored_model = initial  # wrong weights on purpose: loading must restore the model from the masters
    restored = OffloadedOptimizer(restored_model.parameters(), LAMB)
    restored.load_state_dict(saved)
    assert train(restored_model, restored, data[6:]) == expected
    with pytest.raises(ValueError, match="master_weights"):
        OffloadedOptimizer(list(restored_model.parameters())[:-1], LAMB).load_state_dict(saved)


def test_rejects_bad_parameters():
    with pytest.raises(ValueError, match="floating-point"):
        OffloadedOptimizer([torch.zeros(3, dtype=torch.long)])
    weight = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="more than once"):
        OffloadedOptimizer([{"params": [weight]}, {"params": [weight]}])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_model_keeps_only_weights_and_grads_on_device(gpt_config):
    model = LeanGPTForCausalLM(gpt_config()).to("cuda", torch.bfloat16)
    offloaded = OffloadedOptimizer(model.parameters(), LAMB)
    losses = train(model, offloaded, batches(30, model.config.vocab_size))
    assert losses[-1] < 0.6 * losses[0]
    for param, master in zip(model.parameters(), offloaded.masters):
        assert master.device.type == "cpu" and master.is_pinned() and param.grad is None
        assert torch.equal(param.cpu(), master.to(torch.bfloat16))
    assert all(
        value.device.type == "cpu"
        for state in offloaded.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
