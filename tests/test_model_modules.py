"""Building blocks: rotary embeddings, attention masks, RNG hygiene of replayed dropout, the FP32 residual
stream under autocast, and what each memory option keeps for backward."""
from __future__ import annotations

import math

import pytest
import torch

from lean_transformer import LeanAlbertForPreTraining, LeanGPTForCausalLM
from lean_transformer.modules.memory import SavedTensorCounter
from lean_transformer.modules.rotary import apply_rotary, rotary_cos_sin


def test_rotary_matches_its_formula():
    seq_len, head_dim, base = 7, 6, 100.0
    x = torch.randn(seq_len, head_dim, dtype=torch.float64)
    cos, sin = rotary_cos_sin(seq_len, head_dim, base, x.device, torch.float64)
    rotated = apply_rotary(x, cos, sin)
    half = head_dim // 2
    for pos in range(seq_len):
        for i in range(half):
            angle = pos * base ** (-2 * i / head_dim)
            first, second = x[pos, i].item(), x[pos, i + half].item()
            assert rotated[pos, i].item() == pytest.approx(first * math.cos(angle) - second * math.sin(angle), abs=1e-6)
            assert rotated[pos, i + half].item() == pytest.approx(first * math.sin(angle) + second * math.cos(angle),
                                                                  abs=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    head_dim = 8
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)
    cos, sin = rotary_cos_sin(12, head_dim, 10_000.0, q.device, torch.float64)
    score = lambda m, n: (apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])).item()
    assert score(5, 2) == pytest.approx(score(9, 6), abs=1e-6)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


@pytest.mark.parametrize("model_class", [LeanGPTForCausalLM, LeanAlbertForPreTraining])
def test_padding_equals_shorter_sequence(gpt_config, albert_config, model_class):
    config = (gpt_config if model_class is LeanGPTForCausalLM else albert_config)()
    model = model_class(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, 10))
    padded = torch.cat([input_ids, torch.randint(0, config.vocab_size, (1, 4))], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
    logits = lambda out: out.logits if hasattr(out, "logits") else out.prediction_logits
    with torch.no_grad():
        expected = logits(model(input_ids))
        got = logits(model(padded, attention_mask=mask))[:, :10]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_gpt_is_causal(gpt_config):
    model = LeanGPTForCausalLM(gpt_config()).eval()
    input_ids = torch.randint(0, 61, (1, 10))
    changed = input_ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 61
    with torch.no_grad():
        a, b = model(input_ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("options", [dict(), dict(gradient_checkpointing=True, checkpoint_attention_core=True)])
def test_backward_leaves_caller_rng_state_alone(gpt_config, options):
    model = LeanGPTForCausalLM(gpt_config(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)).train()
    model.set_optimizations(**options)
    input_ids = torch.randint(0, 61, (2, 8))
    loss = model(input_ids, labels=input_ids).loss
    state = torch.get_rng_state()
    loss.backward()
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_fp32_residual_under_bf16_autocast(gpt_config, fp32_residual):
    model = LeanGPTForCausalLM(gpt_config(fp32_residual=fp32_residual)).train()
    seen = []
    for layer in model.transformer.encoder.layers:
        layer.ffn.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    input_ids = torch.randint(0, 61, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    residual_dtype = torch.float32 if fp32_residual else torch.bfloat16
    assert seen and all(pair == (residual_dtype, torch.bfloat16) for pair in seen)  # matmuls stay in half precision
    assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("architecture", [dict(), dict(reversible=True), dict(fp32_residual=True, hidden_act="swiglu")])
def test_options_under_bf16_autocast(gpt_config, architecture):
    """In half precision the recomputations may round differently, so gradients agree to bf16 precision."""
    model = LeanGPTForCausalLM(gpt_config(hidden_dropout_prob=0.1, **architecture)).train()
    input_ids = torch.randint(0, 61, (2, 8))
    options = [dict(ffn_custom_grad=False), dict(), dict(checkpoint_attention_core=True)]
    if not architecture.get("reversible"):
        options.append(dict(gradient_checkpointing=2))
    results = []
    for option in options:
        model.set_optimizations(**option)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (reference_loss, reference_grads), *others = results
    for loss, grads in others:
        assert loss == reference_loss  # the forward pass is the same computation under every option
        assert grads.dtype == torch.float32 and grads.isfinite().all()
        assert (grads - reference_grads).norm() <= 1e-2 * reference_grads.norm()


def saved_storages(model, input_ids) -> list[int]:
    """Sizes (in fp32 elements) of the unique non-parameter storages autograd keeps for backward."""
    with SavedTensorCounter(exclude=model.parameters()).record() as counter:
        model(input_ids, labels=input_ids)
    return sorted(nbytes // 4 for nbytes in counter.storages.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_ffn_saves_only_input_preactivation_and_kept_mask(gpt_config, dropout):
    config = gpt_config(num_hidden_layers=1, intermediate_size=64, hidden_dropout_prob=dropout)
    ffn = LeanGPTForCausalLM(config).transformer.encoder.layers[0].ffn.train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    with SavedTensorCounter(exclude=ffn.parameters()).record() as counter:
        ffn(x)
    mask = [2 * 8 * 32] if dropout else []  # one byte per output element: which ones dropout kept
    assert sorted(counter.storages.values()) == [*mask, 2 * 8 * 32 * 4, 2 * 8 * 64 * 4]  # x and the pre-activation


def test_reversible_memory_does_not_grow_with_depth(gpt_config):
    input_ids = torch.randint(0, 61, (2, 8))
    shallow, deep = (saved_storages(LeanGPTForCausalLM(gpt_config(reversible=True, num_hidden_layers=n)), input_ids)
                     for n in (2, 6))
    assert shallow == deep
    plain_deep = saved_storages(LeanGPTForCausalLM(gpt_config(num_hidden_layers=6)), input_ids)
    assert sum(plain_deep) > sum(deep)


def test_checkpointing_keeps_one_hidden_state_per_segment(gpt_config):
    input_ids = torch.randint(0, 61, (2, 8))
    model = LeanGPTForCausalLM(gpt_config(num_hidden_layers=4))
    plain = saved_storages(model, input_ids)
    for segments, expected in ((True, 4), (2, 2)):
        model.set_optimizations(gradient_checkpointing=segments)
        hidden_states = [n for n in saved_storages(model, input_ids) if n == 2 * 8 * 32]
        assert len(hidden_states) == expected + 2  # one per segment, plus the final norm's input and output
    assert len([n for n in plain if n == 2 * 8 * 32]) > 5


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_backward_from_the_preactivation_is_autograds(name, dtype):
    """The feed-forward's backward gets d act / d hidden from the pre-activation alone (no activation output kept):
    the very values autograd gives, zeros and negatives included."""
    from lean_transformer.modules.activations import get_activation, get_activation_backward
    hidden = torch.cat([torch.randn(500), torch.zeros(4), -torch.rand(4)]).to(dtype).requires_grad_()
    grad = torch.randn(508).to(dtype)
    (want,) = torch.autograd.grad(get_activation(name)(hidden), hidden, grad)
    assert torch.equal(get_activation_backward(name)(grad, hidden.detach()), want)
    assert get_activation_backward("swiglu") is None


@pytest.mark.parametrize("hidden_act", ["gelu_new", "relu", "geglu"])
def test_ffn_backward_without_activation_output_is_unchanged(gpt_config, hidden_act):
    """The FFN's hand-written backward gives bitwise the gradients it gave when the activation went through autograd
    (the path gated activations still take)."""
    ffn = LeanGPTForCausalLM(gpt_config(hidden_act=hidden_act)).transformer.encoder.layers[0].ffn
    x = torch.randn(2, 8, 32, requires_grad=True)
    params = [x, *ffn.parameters()]
    results = []
    for backward in (ffn.activation_backward, None):
        ffn.activation_backward = backward
        results.append(torch.autograd.grad(ffn(x).pow(2).sum(), params))
    for got, want in zip(*results):
        assert torch.equal(got, want)
