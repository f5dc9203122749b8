"""HostGradients: gradients leave the model during backward and accumulate in float32 host buffers."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.optim.loss_scale import DynamicLossScale


def backward_twice(model: torch.nn.Module, data: list[torch.Tensor], loss_scale: float = 1.0) -> None:
    for input_ids in data:
        (model(input_ids=input_ids, labels=input_ids).loss * loss_scale).backward()


def test_host_buffers_hold_the_sum_autograd_would_hold_and_the_model_no_gradient(gpt_config):
    model = LeanGPTForCausalLM(gpt_config())
    twin = copy.deepcopy(model)
    data = [torch.randint(61, (2, 16)) for _ in range(2)]
    backward_twice(model, data)  # plain autograd: .grad = a + b
    grads = HostGradients(list(twin.parameters()))
    backward_twice(twin, data)
    grads.wait()
    for param, twin_param, buffer in zip(model.parameters(), twin.parameters(), grads.buffers):
        assert twin_param.grad is None
        assert torch.equal(buffer, param.grad)
    assert all(grads.touched()) and not grads.non_finite()


def test_bfloat16_gradients_accumulate_in_float32_and_unscale_there(gpt_config):
    model = LeanGPTForCausalLM(gpt_config()).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    data = [torch.randint(61, (2, 16)) for _ in range(2)]
    expected = [torch.zeros(param.shape) for param in model.parameters()]
    for input_ids in data:  # the same micro-batches, each gradient converted to float32 and unscaled there
        model.zero_grad()
        (model(input_ids=input_ids, labels=input_ids).loss * 1024.0).backward()
        for total, param in zip(expected, model.parameters()):
            total.add_(param.grad, alpha=1 / 1024)
    grads = HostGradients(list(twin.parameters()))
    grads.grad_scale = 1 / 1024
    backward_twice(twin, data, loss_scale=1024.0)
    grads.wait()
    for total, buffer in zip(expected, grads.buffers):
        assert buffer.dtype == torch.float32
        assert torch.equal(buffer, total)


def test_reset_lets_the_next_gradient_overwrite_and_forgets_non_finite(gpt_config):
    weight = torch.nn.Parameter(torch.ones(4))
    unused = torch.nn.Parameter(torch.ones(2))
    grads = HostGradients([weight, unused])
    (weight * 3.0).sum().backward()
    (weight * float("inf")).sum().backward()
    assert grads.non_finite() and grads.touched() == [True, False]
    grads.reset()
    assert not grads.non_finite() and grads.touched() == [False, False]
    grads.buffers[1].fill_(7.0)  # stale content: zero_untouched_ clears it
    (weight * 2.0).sum().backward()
    grads.zero_untouched_()
    assert grads.buffers[0].tolist() == [2.0] * 4 and grads.buffers[1].tolist() == [0.0] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("summed", [2, 3])
def test_device_sums_reach_the_host_every_nth_gradient_and_on_wait(gpt_config, dtype, summed):
    """device_accumulation: the same float32 sum as one gradient at a time (rounded in another order), unscaled
    as it is summed; a tied weight's two parts count as one gradient; the host sees nothing until the n-th. bfloat16
    weights untied: one at a time, a tied weight's two parts are added in bfloat16 as autograd adds them (``early``),
    while a device sum adds both in float32."""
    model = LeanGPTForCausalLM(gpt_config(tie_word_embeddings=dtype == torch.float32)).to(dtype)
    twin = copy.deepcopy(model)
    data = [torch.randint(61, (2, 16)) for _ in range(5)]
    one_at_a_time = HostGradients(list(model.parameters()))
    grads = HostGradients(list(twin.parameters()), device_accumulation=summed)
    one_at_a_time.grad_scale = grads.grad_scale = 1 / 64
    backward_twice(model, data, loss_scale=64.0)
    backward_twice(twin, data[:summed - 1], loss_scale=64.0)
    assert not any(grads.touched()) and grads.writes > 0  # still on the device
    backward_twice(twin, data[summed - 1:], loss_scale=64.0)
    assert all(grads.touched())  # the n-th gradient sent every sum, before any wait
    one_at_a_time.wait()
    grads.wait()
    for param, expected, buffer in zip(twin.parameters(), one_at_a_time.buffers, grads.buffers):
        assert param.grad is None
        torch.testing.assert_close(buffer, expected, rtol=1e-4, atol=1e-5)


def test_device_sums_end_with_reset_and_reject_a_count_below_one():
    weight = torch.nn.Parameter(torch.ones(4))
    grads = HostGradients([weight], device_accumulation=3)
    (weight * 3.0).sum().backward()
    (weight * float("inf")).sum().backward()
    assert grads.non_finite()
    grads.reset()  # the sum so far is sent, then overwritten: a discarded step leaves nothing behind
    assert not grads.non_finite() and grads.touched() == [False]
    (weight * 2.0).sum().backward()
    grads.wait()
    assert grads.buffers[0].tolist() == [2.0] * 4
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="device_accumulation must be a positive integer"):
            HostGradients([weight], device_accumulation=bad)


def test_remove_hooks_gives_gradients_back_to_the_model():
    weight = torch.nn.Parameter(torch.ones(3))
    grads = HostGradients([weight])
    grads.remove_hooks()
    (weight * 2.0).sum().backward()
    assert weight.grad.tolist() == [2.0] * 3 and grads.writes == 0


def test_rejects_bad_input():
    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="params"):
        HostGradients([])
    with pytest.raises(ValueError, match=r"params\[0\]"):
        HostGradients([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="more than once"):
        HostGradients([weight, weight])
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        HostGradients([weight], buffers=[torch.zeros(3, dtype=torch.float16)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gradients_arrive_on_the_host_and_never_all_sit_on_the_device(gpt_config):
    config = gpt_config(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=4096)
    model = LeanGPTForCausalLM(config).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    data = [torch.randint(4096, (2, 32), device="cuda") for _ in range(2)]
    expected = [torch.zeros(param.shape) for param in model.parameters()]
    for input_ids in data:
        reference.zero_grad()
        reference(input_ids=input_ids, labels=input_ids).loss.backward()
        for total, param in zip(expected, reference.parameters()):
            total.add_(param.grad.cpu())
    del reference
    grads = HostGradients(list(model.parameters()))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    backward_twice(model, data)
    grads.wait()
    assert torch.cuda.memory_allocated() == before  # no gradient left on the device
    for total, buffer in zip(expected, grads.buffers):
        torch.testing.assert_close(buffer, total, rtol=1e-6, atol=1e-8)
    assert all(param.grad is None for param in model.parameters())
    # detached, nothing refers to the model any more: its memory is freed (a benchmark's rows once leaked it)
    grads.remove_hooks()
    assert not grads._thread.is_alive()
    model_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    before_free = torch.cuda.memory_allocated()
    del model, grads
    gc.collect()
    assert torch.cuda.memory_allocated() <= before_free - model_bytes


def test_loss_scale_halves_on_overflow_and_doubles_after_clean_steps():
    scale = DynamicLossScale(initial_scale=8.0, growth_interval=3, min_scale=2.0)
    for overflow, expected in [(True, 4.0), (True, 2.0), (True, 2.0), (False, 2.0), (False, 2.0), (False, 4.0),
                               (False, 4.0), (True, 2.0), (False, 2.0), (False, 2.0), (False, 4.0)]:
        scale.update(overflow)
        assert scale.scale == expected
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScale(growth_interval=0)
    with pytest.raises(ValueError, match="initial_scale"):
        DynamicLossScale(initial_scale=0.5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_sums_cost_four_bytes_a_parameter_and_give_the_host_sum(gpt_config):
    config = gpt_config(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=4096,
                        tie_word_embeddings=False)
    model = LeanGPTForCausalLM(config).to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    data = [torch.randint(4096, (2, 32), device="cuda") for _ in range(5)]
    one_at_a_time = HostGradients(list(model.parameters()))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    grads = HostGradients(list(twin.parameters()), device_accumulation=3)
    sums = torch.cuda.memory_allocated() - before
    exact = sum(4 * param.numel() for param in twin.parameters())
    assert 0 <= sums - exact < 512 * len(list(twin.parameters()))  # the allocator rounds each to 512 bytes
    backward_twice(model, data)
    backward_twice(twin, data)
    one_at_a_time.wait()
    grads.wait()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before + sums  # nothing but the sums stays on the device
    for expected, buffer in zip(one_at_a_time.buffers, grads.buffers):
        torch.testing.assert_close(buffer, expected, rtol=1e-4, atol=1e-5)
