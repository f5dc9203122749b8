"""Attention dispatch: unpadded batches reach SDPA with no mask (``is_causal``), and that path computes exactly what
the masked path computes; chunked attention is exact against SDPA, in gradients too, and replays its dropout."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.modules.attention_mask import AttentionMask, attention_mask_for
from lean_transformer.modules.chunked_attention import chunked_attention
from lean_transformer.modules.replay import dropout_mask


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every call of the real ``F.scaled_dot_product_attention``."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append(kwargs)
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("attention_mask", ["none", "ones", "padded"])
def test_unpadded_batches_reach_sdpa_without_a_mask(gpt_config, sdpa_calls, attention_mask):
    config = gpt_config()
    model = LeanGPTForCausalLM(config).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    mask = {"none": None, "ones": torch.ones_like(input_ids),
            "padded": torch.ones_like(input_ids).index_fill_(1, torch.tensor([10, 11]), 0)}[attention_mask]
    model(input_ids, attention_mask=mask, labels=input_ids).loss.backward()
    assert len(sdpa_calls) == config.num_hidden_layers
    for call in sdpa_calls:
        if attention_mask == "padded":
            assert call["attn_mask"] is not None and call["is_causal"] is False
        else:
            assert call["attn_mask"] is None and call["is_causal"] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unmasked_path_equals_masked_path_exactly(gpt_config, dtype):
    """The causal body run with ``is_causal`` and no mask, and with an explicit all-token mask: bit for bit."""
    config = gpt_config()
    model = LeanGPTForCausalLM(config).to(dtype).train()
    body, input_ids = model.transformer, torch.randint(0, config.vocab_size, (2, 12))

    def logits_and_grads(mask):
        model.zero_grad(set_to_none=True)
        hidden = body.encoder(body.embeddings(input_ids), mask, causal=True)
        logits = model.lm_head(hidden, body.embeddings.word_embeddings.weight)
        logits.square().mean().backward()
        return logits, [p.grad for p in model.parameters()]

    unmasked = logits_and_grads(None)
    masked = logits_and_grads(AttentionMask(torch.ones_like(input_ids, dtype=torch.bool), 12, 12, causal=True))
    assert torch.equal(unmasked[0], masked[0])
    assert all(torch.equal(a, b) for a, b in zip(unmasked[1], masked[1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_unpadded_training_runs_the_flash_kernel(gpt_config):
    """With SDPA restricted to the flash kernel, an unpadded bf16 training step runs; a padded one cannot (flash
    takes no mask), which shows that the restriction is in force."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = gpt_config(hidden_size=128, num_attention_heads=2)  # head_dim 64: a size the flash kernel takes
    model = LeanGPTForCausalLM(config).to("cuda", torch.bfloat16).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 32), device="cuda")
    padded = torch.ones_like(input_ids)
    padded[1, 20:] = 0
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loss = model(input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        with pytest.raises(RuntimeError):
            model(input_ids, attention_mask=padded, labels=input_ids)


def _attention_case(query_len: int, padded: bool, causal: bool, dtype=torch.float32):
    batch, heads, key_len, head_dim = 2, 3, 37, 16
    query = torch.randn(batch, heads, query_len, head_dim, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(batch, heads, key_len, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    padding = torch.ones(batch, key_len, dtype=torch.bool)
    padding[1, :4] = False  # left padding, as in generation
    padding[0, 30:] = False  # right padding, as in training batches
    mask = attention_mask_for(padding if padded else None, query_len, key_len, causal)
    return query, key, value, mask


@pytest.mark.parametrize("chunk_size", [8, 64])
@pytest.mark.parametrize("query_len", [37, 5])  # 5: the last 5 of 37 positions, as after a KV cache
@pytest.mark.parametrize("padded, causal", [(False, False), (False, True), (True, False), (True, True)])
def test_chunked_attention_matches_sdpa(query_len, padded, causal, chunk_size):
    query, key, value, mask = _attention_case(query_len, padded, causal)
    sdpa_mask = mask.dense(query.device) if mask is not None else None
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=sdpa_mask,
                                              is_causal=causal and mask is None)
    grad = torch.randn_like(expected)
    got = chunked_attention(query, key, value, mask, causal, chunk_size=chunk_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (query, key, value), grad),
                    torch.autograd.grad(expected, (query, key, value), grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_chunked_attention_gradcheck(dropout_p):
    query, key, value, mask = _attention_case(37, padded=True, causal=True, dtype=torch.float64)

    def run(query, key, value):
        torch.manual_seed(5)  # the same dropout masks in every evaluation
        return chunked_attention(query, key, value, mask, True, dropout_p, chunk_size=16)

    assert torch.autograd.gradcheck(run, (query, key, value), fast_mode=True)


def test_chunked_attention_dropout_replays_its_masks():
    """Forward and backward equal plain autograd on the same dropout masks, drawn chunk by chunk from the RNG state
    at forward; the RNG stream then continues as if the masks had been drawn once."""
    p, chunk_size = 0.3, 16
    query, key, value, mask = _attention_case(37, padded=True, causal=True)
    grad = torch.randn_like(query)

    torch.manual_seed(7)
    got = chunked_attention(query, key, value, mask, True, p, chunk_size)
    got_grads = torch.autograd.grad(got, (query, key, value), grad)
    after_chunked = torch.rand(4)

    torch.manual_seed(7)
    keep = torch.cat([dropout_mask((2, 3, min(chunk_size, 37 - start), 37), p, torch.float32, query.device)
                      for start in range(0, 37, chunk_size)], dim=2)
    after_masks = torch.rand(4)
    scores = (query @ key.transpose(-1, -2) / 4.0).masked_fill(~mask.dense(query.device), float("-inf"))
    expected = (scores.softmax(-1) * keep) @ value
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad)

    assert torch.equal(after_chunked, after_masks)
    assert 0.2 < (keep == 0).float().mean() < 0.4
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_attention_ignores_autocast():
    """Under bf16 autocast the chunked core still computes in float32 (returning the inputs' dtype), exactly as
    without autocast."""
    query, key, value, mask = _attention_case(37, padded=True, causal=True)
    query, key, value = (t.detach().bfloat16().requires_grad_() for t in (query, key, value))
    grad = torch.randn_like(query)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = chunked_attention(query, key, value, mask, True, chunk_size=16)
        results.append((out, *torch.autograd.grad(out, (query, key, value), grad)))
    assert results[1][0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_attention_core_option(gpt_config, sdpa_calls):
    """"auto" takes the chunked core on CPU with attention dropout only; "sdpa" and "chunked" force either; without
    dropout the two give the same logits and gradients."""
    config = gpt_config(attention_probs_dropout_prob=0.1)
    model = LeanGPTForCausalLM(config).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    model(input_ids, attention_mask=attention_mask)
    assert not sdpa_calls  # auto, CPU, dropout: chunked
    model.set_optimizations(attention_core="sdpa")
    model(input_ids, attention_mask=attention_mask)
    assert len(sdpa_calls) == config.num_hidden_layers

    model.eval()  # no dropout: both cores compute the same function
    results = []
    for core in ("sdpa", "chunked"):
        model.set_optimizations(attention_core=core)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids, attention_mask=attention_mask).logits
        logits[attention_mask.bool()].square().mean().backward()
        results.append((logits, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attention_core"):
        model.set_optimizations(attention_core="flash")
