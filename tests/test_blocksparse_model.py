"""Block-sparse weights inside a full LeanGPT: same logits and gradients whichever backward the feed-forward uses,
no activation saved twice, and parameters that shrink as the layout says."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.modules.blocksparse import BlockSparseLinear
from lean_transformer.modules.linear import SharedLinear

TOL = dict(rtol=1e-4, atol=1e-5)
# hidden 64 = 8 blocks of 8 and inner 256 = 32 blocks: every large matrix keeps 1 + 3 of each 8 blocks, i.e. 1/2
SPARSE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, weight_layout="pixelfly(block_size=8)",
              lowrank_dim=2)


def perturbed(model: nn.Module) -> nn.Module:
    """Move every parameter off its initial value (low-rank V, biases and norms start at constants)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def step(model: LeanGPTForCausalLM, input_ids: torch.Tensor, **options):
    model.set_optimizations(**options)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("options", [dict(ffn_custom_grad=True),
                                     dict(ffn_custom_grad=True, gradient_checkpointing=True)])
@pytest.mark.parametrize("overrides", [
    dict(),
    dict(hidden_act="swiglu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
         weight_layout="hypercube(block_size=16, folded=True, stretch=True)"),
])
def test_custom_ffn_backward_matches_autograd(gpt_config, overrides, options):
    model = perturbed(LeanGPTForCausalLM(gpt_config(**{**SPARSE, **overrides}))).train()
    assert sum(isinstance(m, BlockSparseLinear) for m in model.modules()) == 4 * 2
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    logits, grads = step(model, input_ids, **options)
    ref_logits, ref_grads = step(model, input_ids, ffn_custom_grad=False)  # plain autograd
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


def saved_activation_storages(module: nn.Module, x: torch.Tensor) -> tuple[list[int], int]:
    """The sizes in bytes of the storages that ``module(x)`` saves for backward, parameters excluded, one entry
    per save (a storage saved twice shows up twice), and the number of distinct storages."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: list[tuple[int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.append((storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return [nbytes for _, nbytes in saved], len({ptr for ptr, _ in saved})


def test_custom_ffn_backward_keeps_only_its_input_hidden_state_and_mask(gpt_config):
    config = gpt_config(**SPARSE, hidden_dropout_prob=0.1)
    ffn = LeanGPTForCausalLM(config).body.layers[0].ffn.train()
    x = torch.randn(2, 12, config.hidden_size, requires_grad=True)
    x_bytes = x.numel() * 4

    ffn.custom_grad = True
    saved, distinct = saved_activation_storages(ffn, x)
    assert distinct == len(saved) == 3  # nothing saved twice: the block input, the pre-activation, the kept mask
    assert sorted(saved) == sorted([x_bytes, x_bytes * config.intermediate_size // config.hidden_size,
                                    x.numel()])  # one byte per output element

    ffn.custom_grad = False  # plain autograd keeps the layer-norm output, the activation, the dropout mask, ...
    assert sum(saved_activation_storages(ffn, x)[0]) > sum(saved)


def test_parameters_shrink_as_the_layout_says(gpt_config):
    dense = LeanGPTForCausalLM(gpt_config(**{**SPARSE, "weight_layout": None, "lowrank_dim": 0}))
    sparse = LeanGPTForCausalLM(gpt_config(**SPARSE))
    d, inner, rank = SPARSE["hidden_size"], SPARSE["intermediate_size"], SPARSE["lowrank_dim"]
    shapes = [(3 * d, d), (d, d), (inner, d), (d, inner)]  # qkv, attention output, feed-forward in and out
    removed = sum(out * inp for out, inp in shapes) // 2
    added = sum(rank * (out + inp) for out, inp in shapes)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(sparse) == count(dense) + SPARSE["num_hidden_layers"] * (added - removed)


def test_bad_layout_in_config_raises(gpt_config):
    with pytest.raises(ValueError, match="unknown layout"):
        gpt_config(**{**SPARSE, "weight_layout": "butterfly(block_size=8)"})
    with pytest.raises(ValueError, match="does not divide"):
        LeanGPTForCausalLM(gpt_config(**{**SPARSE, "weight_layout": "pixelfly(block_size=24)"}))


def test_save_and_load_round_trip(gpt_config, tmp_path):
    """The block layout is rebuilt from the config (from_pretrained builds the model on the meta device)."""
    model = perturbed(LeanGPTForCausalLM(gpt_config(**SPARSE))).eval()
    model.save_pretrained(tmp_path)
    loaded = LeanGPTForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def test_shared_block_sparse_matrices_with_adapters(gpt_config):
    """share_large_matrices + weight_layout: each shared matrix is one BlockSparseLinear used by every layer, which
    adds its own adapter and bias; the custom feed-forward backward still matches plain autograd."""
    config = gpt_config(**{**SPARSE, "num_hidden_layers": 4}, share_large_matrices=True, num_shared_matrices=2,
                        adapter_dim=3)
    model = perturbed(LeanGPTForCausalLM(config)).train()
    sparse = [m for m in model.modules() if isinstance(m, BlockSparseLinear)]
    assert len(sparse) == 4 * 2 and all(m.bias is None for m in sparse)  # 4 matrices in each of 2 shared sets
    users = {id(m.shared) for m in model.modules() if isinstance(m, SharedLinear)}
    assert users == {id(m) for m in sparse}  # every layer's projection goes through a shared block-sparse matrix

    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    logits, grads = step(model, input_ids, ffn_custom_grad=True)
    ref_logits, ref_grads = step(model, input_ids, ffn_custom_grad=False)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys()
    assert all(grad.abs().sum() > 0 for name, grad in grads.items() if "adapter" in name or "blocks" in name)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
