"""The trainer's ``--block_grad_scaling`` glue (``swarm/averaging/block_scaling.py``) on a tiny LeanGPT under float16 autocast
on the CPU: one block whose gradients are 2^20 times larger overflows, so one global scale (torch's GradScaler)
skips the whole step, while the per-block path zeroes that block alone; every other gradient equals GradScaler's
on a model whose overflowing block passes no gradient back (what the per-block path does for that step), and the
gradients accumulated over two local steps with a scale change between them (``--reuse_grad_buffers``) are the
sum of the two steps' unscaled gradients. The end-to-end trainer run is in test_trainer_swarm.py (lone_peers)."""
from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.grad_scaling import _GradGain
from lean_transformer import LeanGPTForCausalLM
from lean_transformer.swarm.averaging.block_scaling import SwarmBlockScaling
from lean_transformer.swarm.peers.trainer import format_scales

GAIN = 2.0 ** 20  # block HOT's inner gradients are this much larger than the plain block's
HOT, SCALE = 2, 2.0 ** 10  # block 2: layer 1's attention; every block starts at SCALE


def blocks_of(model: LeanGPTForCausalLM) -> list[torch.nn.Module]:
    return [sub for layer in model.body.layers for sub in (layer.attention, layer.ffn)]


def amplify(block: torch.nn.Module) -> None:
    """Forward unchanged, the residual stream's gradient unchanged, the block's own gradients times GAIN (the
    benchmark's GainBlock, as hooks)."""
    block.register_forward_pre_hook(lambda _module, args: (_GradGain.apply(args[0], 1 / GAIN), *args[1:]))
    block.register_forward_hook(lambda _module, _args, output: _GradGain.apply(output, GAIN))


def global_scale_step(model: LeanGPTForCausalLM, input_ids: torch.Tensor) -> tuple[list, bool]:
    """Unscaled gradients under torch's GradScaler at SCALE and whether it found an overflow (then it skips)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids, labels=input_ids).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    overflow = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()) > 0
    return [param.grad for param in model.parameters()], overflow


def local_step(model: LeanGPTForCausalLM, scaling: SwarmBlockScaling, input_ids: torch.Tensor):
    scaling.before_backward()
    with torch.autocast("cpu", dtype=torch.float16):
        scaling.scale_loss(model(input_ids, labels=input_ids).loss).backward()
    return scaling.after_backward()


@pytest.fixture
def models(gpt_config):
    """(the model with the hot block under per-block scaling, its scaling, the same weights without that block's
    backward: its output detached)"""
    model = LeanGPTForCausalLM(gpt_config(num_hidden_layers=2, fp32_residual=True)).train()
    reference = copy.deepcopy(model)
    blocks_of(reference)[HOT].register_forward_hook(lambda _module, _args, output: output.detach())
    amplify(blocks_of(model)[HOT])  # before the scaler's hooks: the scaler sees the amplified block
    scaling = SwarmBlockScaling.for_lean_model(model, init_scale=SCALE, growth_interval=2)
    return model, scaling, reference


def test_one_global_scale_skips_the_step_the_block_scales_drop_one_block(gpt_config, models):
    model, scaling, reference = models
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    hot = {id(p) for p in scaling.scaler.groups[HOT]}

    plain = LeanGPTForCausalLM(gpt_config(num_hidden_layers=2, fp32_residual=True)).train()
    plain.load_state_dict(model.state_dict())
    amplify(blocks_of(plain)[HOT])
    assert global_scale_step(plain, input_ids)[1]  # one scale: this step overflows and is skipped whole

    expected, overflow = global_scale_step(reference, input_ids)
    assert not overflow
    outcome = local_step(model, scaling, input_ids)
    assert (outcome.overflowed_blocks, outcome.others_finite, outcome.finite) == (1, True, False)
    for (name, param), grad in zip(model.named_parameters(), expected):
        if id(param) in hot:
            assert grad is None and torch.count_nonzero(param.grad) == 0, name
        else:
            torch.testing.assert_close(param.grad, grad, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
    assert scaling.scales == [SCALE, SCALE, SCALE / 2, SCALE]
    assert format_scales(scaling.scales) == "2^9..2^10"

    before = [param.detach().clone() for param in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for (name, param), old in zip(model.named_parameters(), before):
        assert torch.equal(param, old) == (id(param) in hot), name  # only the hot block keeps its weights


def test_gradients_accumulated_over_a_scale_change_are_the_sum_of_unscaled_steps(models):
    model, scaling, reference = models
    batches = [torch.randint(0, model.config.vocab_size, (2, 12)) for _ in range(2)]
    first, _ = global_scale_step(reference, batches[0])
    first = [None if grad is None else grad.clone() for grad in first]
    reference.zero_grad(set_to_none=True)
    second, _ = global_scale_step(reference, batches[1])

    local_step(model, scaling, batches[0])  # .grad kept between the steps, as with --reuse_grad_buffers
    scales_between = scaling.scales
    outcome = local_step(model, scaling, batches[1])
    assert outcome.overflowed_blocks == 1  # the hot block again, at 2^9
    assert scales_between == [SCALE, SCALE, SCALE / 2, SCALE]
    assert scaling.scales == [2 * SCALE, 2 * SCALE, SCALE / 4, 2 * SCALE]  # 2 finite steps in a row: grown
    hot = {id(p) for p in scaling.scaler.groups[HOT]}
    for (name, param), a, b in zip(model.named_parameters(), first, second):
        if id(param) in hot:
            assert torch.count_nonzero(param.grad) == 0, name
        else:
            torch.testing.assert_close(param.grad, a + b, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")

    # the next step scales the buffers by the new scales: the blocks' 2^11, the rest (the loss scale) 2^10
    scaling.before_backward()
    others = {id(p) for p in scaling.scaler.other_params}
    for (name, param), a, b in zip(model.named_parameters(), first, second):
        if id(param) not in hot:
            factor = SCALE if id(param) in others else 2 * SCALE
            torch.testing.assert_close(param.grad, (a + b) * factor, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")


def test_an_overflow_outside_the_blocks_halves_the_loss_scale_only(models):
    """The head, embeddings and final norm run at the loss scale: their overflow drops the step (the trainer
    discards it) and halves the loss scale, not the blocks' own scales."""
    model, scaling, _ = models
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    scaling.before_backward()
    with torch.autocast("cpu", dtype=torch.float16):
        scaling.scale_loss(model(input_ids, labels=input_ids).loss).backward()
    scaling.scaler.other_params[-1].grad[0] = float("inf")  # as if the final norm's gradient had overflowed
    outcome = scaling.after_backward()
    assert (outcome.overflowed_blocks, outcome.others_finite, outcome.finite) == (0, False, False)
    assert scaling.loss_scale.scale == SCALE / 2
    assert scaling.scaler.scales.tolist() == [1.0] * 4 and scaling.scaler.found_inf.tolist() == [0.0] * 4


def test_the_trainer_refuses_what_block_scaling_cannot_scale(gpt_config):
    from lean_transformer.swarm.peers.trainer import make_block_scaling

    chunked = LeanGPTForCausalLM(gpt_config())
    chunked.set_optimizations(backward_chunks=2)
    with pytest.raises(ValueError, match=r"^--block_grad_scaling: .*backward_chunks"):
        make_block_scaling(chunked)
