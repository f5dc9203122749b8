"""Chunked linear + cross-entropy (``modules/fused_loss.py``) and the models' ``return_logits=False``: the same loss
and gradients as logits + ``F.cross_entropy`` (float32 tight, float64 gradcheck, bf16/fp16 autocast within those
dtypes' precision), ignore_index and tied embeddings included, and the full logits never exist."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lean_transformer import LeanAlbertForPreTraining, LeanGPTForCausalLM
from lean_transformer.modules import fused_loss
from lean_transformer.modules.fused_loss import linear_cross_entropy

TOL = dict(rtol=1e-4, atol=1e-5)


def plain_loss(hidden, weight, labels, bias=None):
    return F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2).float(), labels.flatten(), ignore_index=-100)


def loss_and_grads(loss_fn, tensors):
    loss = loss_fn(*tensors)
    return loss.detach(), torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 7, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_plain_cross_entropy(chunk_rows, with_bias):
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    bias = torch.randn(37, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 37, (3, 9))
    labels[0, :5] = -100
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    reference = loss_and_grads(lambda h, w, *b: plain_loss(h, w, labels, *b), tensors)
    result = loss_and_grads(lambda h, w, *b: linear_cross_entropy(h, w, labels, *b, chunk_rows=chunk_rows), tensors)
    torch.testing.assert_close(result[0], reference[0], **TOL)
    for got, want in zip(result[1], reference[1]):
        torch.testing.assert_close(got, want, **TOL)


def test_gradcheck_float64():
    hidden = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (7,))
    labels[2] = -100
    assert torch.autograd.gradcheck(lambda h, w, b: linear_cross_entropy(h, w, labels, b, chunk_rows=3),
                                    (hidden, weight, bias))


def test_no_label_counts_gives_nan_like_cross_entropy():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    labels = torch.full((4,), -100)
    assert plain_loss(hidden, weight, labels).isnan()
    assert linear_cross_entropy(hidden, weight, labels).isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matches_plain_autocast(dtype):
    """The chunk's logits are computed in the autocast dtype and upcast to fp32 one chunk at a time, as the plain
    path upcasts all of them: same loss, same hidden gradient. The weight gradient sums the chunks in fp32 where the
    plain path rounds its sums to the low-precision dtype: they differ by that dtype's rounding (compared as whole
    tensors: single entries that cancel to near zero carry no relative precision in either path)."""
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = (0.1 * torch.randn(300, 32)).requires_grad_()
    labels = torch.randint(0, 300, (64,))
    labels[::3] = -100
    with torch.autocast("cpu", dtype=dtype):
        reference = loss_and_grads(lambda h, w: plain_loss(h, w, labels), [hidden, weight])
        result = loss_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, chunk_rows=10), [hidden, weight])
    assert result[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in result[1])
    torch.testing.assert_close(result[0], reference[0], **TOL)
    torch.testing.assert_close(result[1][0], reference[1][0], **TOL)
    eps = torch.finfo(dtype).eps
    assert (result[1][1] - reference[1][1]).norm() <= eps * reference[1][1].norm()


def test_bad_arguments_name_themselves():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="labels has shape"):
        linear_cross_entropy(hidden, weight, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="input features"):
        linear_cross_entropy(hidden, torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), chunk_rows=0)


class LargestLogits(TorchDispatchMode):
    """The most elements of any tensor of logits (last dimension ``vocab_size``) an op produced while active."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.numel = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[-1] == self.vocab_size:
                self.numel = max(self.numel, t.numel())
        return out


def model_step(model, inputs: dict, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_gradients(model, input_ids: torch.Tensor, fused: tuple, plain: tuple) -> None:
    """The chunked loss's (output, gradients) equal the plain loss's; without labels the model refuses to run."""
    (result, grads), (reference, ref_grads) = fused, plain
    torch.testing.assert_close(result.loss, reference.loss, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="return_logits=False needs labels"):
        model(input_ids, return_logits=False)


@pytest.mark.parametrize("architecture", [dict(), dict(tie_word_embeddings=False), dict(embedding_size=16)])
def test_gpt_return_logits_false_matches(gpt_config, architecture):
    config = gpt_config(vocab_size=512, max_position_embeddings=128, **architecture)
    model = LeanGPTForCausalLM(config).train()
    input_ids = torch.randint(0, config.vocab_size, (8, 128))  # 1024 tokens: 8 chunks of fused.MIN_CHUNK_ROWS
    mask = torch.ones_like(input_ids)
    mask[1, 97:] = 0
    inputs = dict(input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100))
    with LargestLogits(config.vocab_size) as plain:
        reference, ref_grads = model_step(model, inputs)
    with LargestLogits(config.vocab_size) as fused:
        result, grads = model_step(model, inputs, return_logits=False)
    assert result.logits is None
    assert plain.numel == input_ids.numel() * config.vocab_size  # the counter sees full logits where they exist
    assert 0 < fused.numel <= input_ids.numel() * config.vocab_size / 8
    assert_same_loss_and_gradients(model, input_ids, (result, grads), (reference, ref_grads))


def test_albert_return_logits_false_matches(albert_config):
    config = albert_config(vocab_size=512, embedding_size=16)
    model = LeanAlbertForPreTraining(config).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = torch.full_like(input_ids, -100)
    labels[:, ::5] = input_ids[:, ::5]  # the masked positions
    inputs = dict(input_ids=input_ids, labels=labels, token_type_ids=(torch.arange(24) >= 12).long().expand(2, 24),
                  sentence_order_label=torch.tensor([0, 1]))
    reference, ref_grads = model_step(model, inputs)
    result, grads = model_step(model, inputs, return_logits=False)
    assert result.prediction_logits is None and result.sop_logits is not None
    assert_same_loss_and_gradients(model, input_ids, (result, grads), (reference, ref_grads))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or fused_loss.LigerFusedLinearCrossEntropyLoss is None,
                    reason="needs a CUDA GPU and liger-kernel")
def test_liger_path_matches_ours_on_cuda():
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    weight = (0.1 * torch.randn(1000, 64, device="cuda")).requires_grad_()
    labels = torch.randint(0, 1000, (300,), device="cuda")
    labels[::7] = -100
    ours = loss_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, use_liger=False), [hidden, weight])
    liger = loss_and_grads(lambda h, w: linear_cross_entropy(h, w, labels), [hidden, weight])
    torch.testing.assert_close(liger[0], ours[0], **TOL)
    for got, want in zip(liger[1], ours[1]):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_scales_and_converts_blockwise_to_the_same_values(dtype):
    """Backward hands the stored float32 gradients back as ``(grad * grad_loss).to(dtype)``, converting a block at a
    time (no whole-size float32 temporary): the very same values, across block boundaries and a ragged last block."""
    stored = torch.randn(37, 11) * 100
    scale = torch.tensor(0.37)
    got = fused_loss.scaled_to(stored, scale, dtype, block=50)
    assert got.dtype == dtype and got.shape == stored.shape
    assert torch.equal(got, (stored * scale).to(dtype))


def test_low_precision_weights_get_the_rounded_scaled_gradient():
    """bfloat16 weights and hidden states (no autocast), a loss scaled by 3: each gradient is the float32 chunked
    gradient times 3, rounded once to bfloat16."""
    hidden = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(300, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 300, (40,))
    loss = linear_cross_entropy(hidden, weight, labels, chunk_rows=7)
    got = torch.autograd.grad(loss, [hidden, weight], torch.tensor(3.0))
    _, *stored = fused_loss._chunks(hidden.detach(), weight.detach(), None, labels, -100, 7, (True, True, False))
    for grad, want in zip(got, stored[:2]):
        assert grad.dtype == torch.bfloat16
        assert torch.equal(grad, (want * 3.0).to(torch.bfloat16))
