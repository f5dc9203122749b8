"""gradcheck (float64) for every hand-written backward: the FFN function, the LinearOp backward of each kind,
checkpointing and the reversible stack; dropout masks are replayed, so runs with dropout are checked too.
gradcheck runs in fast mode (random projections of the Jacobian) to keep the suite quick; checkpointing and the
reversible stack are checked against their inputs and a sample of parameters of every kind."""
from __future__ import annotations

import pytest
import torch

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.modules.checkpoint import checkpoint, reversible
from lean_transformer.modules.ffn import _FFNFunction
from lean_transformer.modules.linear import DenseLinear, SharedLinear, SharedMatrix

SMALL = dict(hidden_size=8, num_attention_heads=2, intermediate_size=12, num_hidden_layers=2)


def double_model(config) -> LeanGPTForCausalLM:
    model = LeanGPTForCausalLM(config).double().train()
    for name, param in model.named_parameters():
        if "adapter_out" in name or "bias" in name:  # zero at init: make their gradients paths non-trivial
            torch.nn.init.normal_(param, std=0.5)
    return model


def sample(body, layer: int) -> list[torch.Tensor]:
    """A few parameters of one layer: a norm weight, a projection weight, a bias."""
    layer = body.layers[layer]
    return [layer.attention.pre_norm.weight, layer.ffn.dense_out.weight, layer.attention.qkv.bias]


def seeded(function):
    """Reseed before each call, so that gradcheck's repeated forwards draw the same dropout masks."""
    def wrapped(*args):
        torch.manual_seed(7)
        return function(*args)
    return wrapped


@pytest.mark.parametrize("architecture", [
    dict(hidden_act="gelu_new"),
    dict(hidden_act="swiglu", sandwich_norm=True),
    dict(hidden_act="relu", share_large_matrices=True, adapter_dim=3),
])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("chunks", [1, 4])  # 4 chunks over 6 tokens: uneven ones
def test_ffn_backward_gradcheck(gpt_config, architecture, dropout, chunks):
    model = double_model(gpt_config(**SMALL, **architecture, hidden_dropout_prob=dropout))
    ffn = model.transformer.encoder.layers[0].ffn
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    params = [t for part in ffn._parts() for t in part]
    assert torch.autograd.gradcheck(seeded(lambda *args: _FFNFunction.apply(ffn, dropout, chunks, *args)),
                                    (x, *params), fast_mode=True)


@pytest.mark.parametrize("kind", ["dense", "shared-with-adapter"])
def test_linear_op_backward_matches_autograd(kind):
    if kind == "dense":
        layer = DenseLinear(6, 5).double()
    else:
        layer = SharedLinear(SharedMatrix(6, 5).double(), adapter_dim=2).double()
        torch.nn.init.normal_(layer.adapter_out)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    params = layer.op_params()
    out = layer.op_forward(x, params)
    grad_y = torch.randn_like(out)
    expected = torch.autograd.grad(out, (x, *params), grad_y)
    grad_x, grads = layer.op_backward(x.detach(), grad_y, params)
    assert len(grads) == len(params)
    for got, want in zip((grad_x, *grads), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpoint_gradcheck(gpt_config, dropout):
    model = double_model(gpt_config(**SMALL, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
    body = model.transformer.encoder
    segment = body.sublayers(None, True, seq_len=3, device=torch.device("cpu"))[:2]
    params = body.trainable_tensors([body.layers[0]])

    def run(x, *unused_params):
        return checkpoint(lambda h: body._run(segment, h), (x,), params)

    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(seeded(run), (x, *sample(body, 0)), fast_mode=True)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_reversible_gradcheck(gpt_config, dropout):
    model = double_model(gpt_config(**SMALL, reversible=True, hidden_dropout_prob=dropout))
    body = model.transformer.encoder
    branches = body.sublayers(None, False, seq_len=3, device=torch.device("cpu"))
    params = body.trainable_tensors([body.layers])

    def run(x0, x1, *unused_params):
        return reversible(branches, x0, x1, params)

    x0, x1 = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(seeded(run), (x0, x1, *sample(body, 0), *sample(body, 1)), fast_mode=True)
