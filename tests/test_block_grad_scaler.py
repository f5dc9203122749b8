"""Per-block gradient scaling (``optim/block_grad_scaler.py``): with every scale equal it reproduces
``torch.amp.GradScaler`` exactly; on a deep fp16 model whose blocks' gradients span more than fp16's range it trains
every block where one global scale leaves some blocks with all-zero (underflowed) gradients."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from benchmarks.grad_scaling import GAINS, DeepNet  # the benchmark's deep net: 8 blocks, a 2^48 gradient spread
from lean_transformer import LeanGPTForCausalLM
from lean_transformer.optim.block_grad_scaler import BlockGradScaler


@pytest.mark.parametrize("options, architecture", [
    (dict(), dict()),
    (dict(), dict(fp32_residual=True, hidden_dropout_prob=0.1)),
    (dict(gradient_checkpointing=True), dict()),
    (dict(), dict(reversible=True)),
])
def test_equal_scales_reproduce_grad_scaler(gpt_config, options, architecture):
    """Powers of two scale exactly, so per-block scaling at 2^10 everywhere gives GradScaler's unscaled gradients
    and the same optimizer step."""
    model = LeanGPTForCausalLM(gpt_config(num_hidden_groups=2, **architecture)).train()
    model.set_optimizations(**options)
    reference_model = copy.deepcopy(model)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.Adam(reference_model.parameters(), lr=1e-3)

    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    torch.manual_seed(5)
    grad_scaler.scale(reference_model(input_ids, labels=input_ids).loss).backward()
    grad_scaler.unscale_(reference_optimizer)

    block_scaler = BlockGradScaler.for_lean_model(model, init_scale=2.0 ** 10)
    torch.manual_seed(5)
    model(input_ids, labels=input_ids).loss.backward()
    block_scaler.unscale_()

    for (name, param), reference in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
    block_scaler.step(optimizer)
    grad_scaler.step(reference_optimizer)
    for param, reference in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(param, reference, rtol=1e-6, atol=0)
    assert block_scaler.skipped_blocks == 0


STEPS, WARM_UP = 250, 100


def train(mode: str) -> dict:
    torch.manual_seed(0)
    teacher = DeepNet(16, [1.0] * len(GAINS))
    inputs = torch.randn(1024, 16)
    with torch.no_grad():
        for param in teacher.parameters():
            param.mul_(3)
        targets = teacher(inputs)
    torch.manual_seed(1)
    model = DeepNet(16, GAINS)
    initial = [block.dense_out.weight.detach().clone() for block in model.blocks]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-30)
    block_scaler = BlockGradScaler(list(model.blocks), other_params=model.head.parameters(), init_scale=2.0 ** 32,
                                   max_scale=2.0 ** 32, growth_interval=10 ** 6)
    grad_scaler = torch.amp.GradScaler("cpu", growth_interval=10 ** 6)
    losses, skipped = [], []
    for _ in range(STEPS):
        batch = torch.randint(0, len(inputs), (32,))
        with torch.autocast("cpu", dtype=torch.float16, enabled=mode != "fp32"):
            loss = F.mse_loss(model(inputs[batch]).float(), targets[batch])
        optimizer.zero_grad()
        if mode == "per-block":
            loss.backward()
            block_scaler.step(optimizer)
            block_scaler.update()
            skipped.append(block_scaler.skipped_blocks)
        elif mode == "global":
            scale = grad_scaler.get_scale()
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            skipped.append(len(GAINS) if grad_scaler.get_scale() < scale else 0)  # it backs off only then
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    moved = [bool((block.dense_out.weight != w).any()) for block, w in zip(model.blocks, initial)]
    return dict(first=sum(losses[:10]) / 10, last=sum(losses[-30:]) / 30, skipped=skipped, moved=moved)


def test_per_block_scaling_trains_where_one_scale_cannot():
    fp32, per_block, global_scale = train("fp32"), train("per-block"), train("global")
    assert per_block["last"] < 0.2 * per_block["first"]
    assert per_block["last"] < 1.15 * fp32["last"]
    assert all(per_block["moved"])
    assert sum(per_block["skipped"][:WARM_UP]) > 0 and sum(per_block["skipped"][WARM_UP:]) == 0
    # the one scale low enough for the 2^16-gain block underflows every gradient of the 2^-32-gain blocks
    assert global_scale["moved"][:5] == [False] * 5
    assert global_scale["last"] > 1.3 * fp32["last"]


def test_state_dict_round_trip_and_remove(gpt_config):
    model = LeanGPTForCausalLM(gpt_config())
    scaler = BlockGradScaler.for_lean_model(model, init_scale=8.0)
    scaler.scales[0] = 2.0
    other = BlockGradScaler.for_lean_model(LeanGPTForCausalLM(gpt_config()))
    other.load_state_dict(scaler.state_dict())
    assert other.scales.tolist() == scaler.scales.tolist()
    other.remove()
    scaler.remove()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    reference = copy.deepcopy(model)
    model(input_ids, labels=input_ids).loss.backward()
    reference(input_ids, labels=input_ids).loss.backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=0, atol=0)  # hooks gone: no scaling at all


def test_rejects_what_it_cannot_scale(gpt_config):
    with pytest.raises(ValueError, match="belongs to blocks"):
        BlockGradScaler.for_lean_model(LeanGPTForCausalLM(gpt_config(share_large_matrices=True)))
    chunked = LeanGPTForCausalLM(gpt_config())
    chunked.set_optimizations(backward_chunks=2)
    with pytest.raises(ValueError, match="backward_chunks"):
        BlockGradScaler.for_lean_model(chunked)
    with pytest.raises(ValueError, match="growth_factor > 1"):
        BlockGradScaler.for_lean_model(LeanGPTForCausalLM(gpt_config()), growth_factor=1.0)
    with pytest.raises(ValueError, match="at least one"):
        BlockGradScaler([])
