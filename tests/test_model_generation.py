"""Generation with transformers' ``generate`` and its KV cache: a LeanGPT converted from GPT-2 generates exactly what
GPT-2 generates; cached decoding computes the logits of a full forward pass for every architecture; unsupported
arguments raise."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.models.generation import sample_text
from lean_transformer.models.gpt import CACHE_FIELD


def cache_of(output) -> DynamicCache:
    """The returned KV cache, under the field name of the installed transformers (see CACHE_FIELD)."""
    return getattr(output, CACHE_FIELD)


TOL = dict(rtol=1e-4, atol=1e-5)
GPT2_TINY = dict(vocab_size=97, n_positions=64, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)


@pytest.fixture(scope="module")
def gpt2_pair() -> tuple[GPT2LMHeadModel, LeanGPTForCausalLM]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**GPT2_TINY)).eval()
    with torch.no_grad():  # larger weights than GPT-2's init give peaked, varied next-token distributions
        for param in hf.parameters():
            param.mul_(4.0)
    return hf, LeanGPTForCausalLM.from_hf_gpt2(hf).eval()


def prompts(left_padded: bool) -> dict:
    input_ids = torch.randint(2, 97, (3, 7))
    attention_mask = torch.ones_like(input_ids)
    if left_padded:
        attention_mask[1, :3] = 0
        attention_mask[2, :1] = 0
        input_ids = input_ids.masked_fill(attention_mask == 0, 1)
    return dict(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("left_padded", [False, True])
@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=False, num_beams=3),
                                  dict(do_sample=True, top_k=20)])
def test_generates_what_gpt2_generates(gpt2_pair, mode, left_padded):
    hf, lean = gpt2_pair
    inputs = prompts(left_padded)
    outputs = []
    for model in (hf, lean):
        torch.manual_seed(1)  # sampling draws the same numbers from the same distributions
        outputs.append(model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, **mode))
    assert outputs[0].shape == (3, 7 + 24)
    assert torch.equal(outputs[1], outputs[0])
    assert len(set(outputs[0][:, 7:].flatten().tolist())) > 5  # varied text: the comparison could fail


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=False, num_beams=3)])
def test_generates_on_cuda_what_gpt2_generates(gpt2_pair, mode):
    """Left-padded prompts on CUDA (SDPA with a mask while prefilling, the cache while decoding): the same tokens as
    GPT-2 on CUDA."""
    hf, lean = (model.cuda() for model in gpt2_pair)
    try:
        inputs = {name: tensor.cuda() for name, tensor in prompts(left_padded=True).items()}
        expected, got = (model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, **mode) for model in (hf, lean))
        assert torch.equal(got, expected)
        assert len(set(expected[:, 7:].flatten().tolist())) > 5
    finally:
        hf.cpu(), lean.cpu()


@pytest.mark.parametrize("architecture", [
    dict(),  # rotary
    dict(position_embedding_type="absolute", hidden_act="relu"),
    dict(hidden_act="swiglu", sandwich_norm=True, fp32_residual=True, num_hidden_groups=2, num_inner_groups=2),
    dict(reversible=True, share_large_matrices=True, adapter_dim=4),
])
def test_cached_decoding_matches_full_forward(gpt_config, architecture):
    """Prefill 5 positions, then a chunk of 3, then one at a time: each step's logits equal those of one forward
    pass over the whole (left-padded) sequence."""
    config = gpt_config(**architecture)
    model = LeanGPTForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        cache, got = DynamicCache(config=config), []
        for start, end in [(0, 5), (5, 8), *((i, i + 1) for i in range(8, 12))]:
            out = model(input_ids[:, start:end], attention_mask=attention_mask[:, :end],
                        position_ids=position_ids[:, start:end], past_key_values=cache)
            assert cache_of(out) is cache and cache.get_seq_length() == end
            got.append(out.logits)
    valid = attention_mask.bool()
    torch.testing.assert_close(torch.cat(got, 1)[valid], expected[valid], **TOL)


@pytest.mark.parametrize("position_embedding_type", ["rotary", "absolute"])
def test_default_positions_continue_after_the_cache(gpt_config, position_embedding_type):
    """Without position_ids, the new positions follow the cached ones."""
    config = gpt_config(position_embedding_type=position_embedding_type)
    model = LeanGPTForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = model(input_ids).logits
        first = model(input_ids[:, :7], use_cache=True)
        second = model(input_ids[:, 7:], cache=cache_of(first))  # the name since transformers 5.24
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), expected, **TOL)


def test_generate_with_and_without_cache_agree(gpt_config):
    model = LeanGPTForCausalLM(gpt_config(max_position_embeddings=64)).eval()
    input_ids = torch.randint(0, 61, (2, 5))
    with_cache = model.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    without = model.generate(input_ids, max_new_tokens=20, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(with_cache, without)


def test_unsupported_arguments_raise(gpt_config):
    config = gpt_config()
    model = LeanGPTForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 6))
    with pytest.raises(TypeError, match="inputs_embeds"):
        model(input_ids, inputs_embeds=torch.zeros(2, 6, 32))
    with pytest.raises(TypeError, match="token_type_ids"):
        model(input_ids, token_type_ids=torch.zeros_like(input_ids))
    for name in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match=name):
            model(input_ids, **{name: True})
    with pytest.raises(ValueError, match="return_dict"):
        model(input_ids, return_dict=False)
    with pytest.raises(TypeError, match="past_key_values must be a transformers Cache"):
        model(input_ids, past_key_values=((torch.zeros(2, 4, 3, 8),) * 2,) * 4)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids, labels=input_ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(input_ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids, position_ids=torch.arange(5)[None])
    cache = cache_of(model(input_ids, use_cache=True))
    with pytest.raises(ValueError, match="not both"):
        model(input_ids, cache=cache, past_key_values=cache)
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        model(input_ids, cache=[])
    with pytest.raises(ValueError, match="after 6 cached ones"):  # 6 + 30 > max_position_embeddings=32
        model(torch.randint(0, config.vocab_size, (2, 30)), past_key_values=cache)
    with pytest.raises(ValueError, match="not used by the model.*num_experts"):  # generate's own check of kwargs
        model.generate(input_ids, max_new_tokens=2, num_experts=2)


def test_cache_with_recomputation_under_autograd_raises(gpt_config):
    model = LeanGPTForCausalLM(gpt_config(reversible=True))
    input_ids = torch.randint(0, 61, (2, 6))
    with pytest.raises(ValueError, match="reversible=True or gradient_checkpointing"):
        model(input_ids, use_cache=True)
    with torch.no_grad():
        assert cache_of(model(input_ids, use_cache=True)).get_seq_length() == 6


class _Bytes:
    """A byte tokenizer with an end-of-text id, the shape of tasks.tokenizer.ByteTokenizer."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_sample_text(gpt_config):
    model = LeanGPTForCausalLM(gpt_config(vocab_size=257, max_position_embeddings=64)).train()
    tokenizer = _Bytes()
    state = torch.get_rng_state()
    first = sample_text(model, tokenizer, ["ab", ""], max_new_tokens=10, temperature=0.8, top_k=40, seed=3)
    assert torch.equal(torch.get_rng_state(), state) and model.training  # caller's RNG and mode untouched
    assert first == sample_text(model, tokenizer, ["ab", ""], max_new_tokens=10, temperature=0.8, top_k=40, seed=3)
    assert len(first) == 2 and all(isinstance(text, str) for text in first)
    greedy = sample_text(model, tokenizer, ["ab"], max_new_tokens=10, do_sample=False)
    ids = model.eval().generate(torch.tensor([[256, 97, 98]]), max_new_tokens=10, do_sample=False,
                                pad_token_id=256, eos_token_id=256)[0, 3:].tolist()
    assert greedy == [tokenizer.decode(ids[:ids.index(256)] if 256 in ids else ids)]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample_text(model, tokenizer, ["x" * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_text(model, tokenizer, ["ab"], max_new_tokens=0)
