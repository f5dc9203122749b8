"""Attention dispatch: unpadded batches reach SDPA with no mask (``is_causal``), and that path computes exactly what
the masked path computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.modules.attention import AttentionMask


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
