"""modules/early_grad.py: a tied table's head gradient handed off before the lookup's, and HostGradients taking it
so; the gradients (and the host buffers) are the very values plain autograd gives."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lean_transformer import LeanGPTForCausalLM
from lean_transformer.modules.early_grad import handoff, set_receiver
from lean_transformer.optim.grad_offload import HostGradients


def tied_loss(table: torch.Tensor, head_table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    hidden = F.embedding(ids, table).tanh()
    return F.cross_entropy(hidden @ head_table.t(), ids)


@pytest.fixture
def table():
    return torch.nn.Parameter(torch.randn(11, 6))


def test_without_receiver_the_gradient_flows_as_usual(table):
    ids = torch.randint(11, (9,))
    tied_loss(table, table, ids).backward()
    want, table.grad = table.grad, None
    tied_loss(table, handoff(table), ids).backward()
    assert torch.equal(table.grad, want)


def test_receiver_gets_the_head_part_before_the_lookup_part_is_accumulated(table):
    ids = torch.randint(11, (9,))
    tied_loss(table, table, ids).backward()
    want, table.grad = table.grad, None
    events = []
    set_receiver(table, lambda grad: events.append(("head", grad.clone())))
    table.register_post_accumulate_grad_hook(lambda p: events.append(("hook", p.grad.clone())))
    tied_loss(table, handoff(table), ids).backward()
    assert [name for name, _ in events] == ["head", "hook"]
    assert torch.equal(events[0][1] + events[1][1], want)  # the sum autograd forms, in the same dtype
    set_receiver(table, None)
    table.grad = None
    tied_loss(table, handoff(table), ids).backward()
    assert torch.equal(table.grad, want) and len(events) == 3  # receiver gone: the whole gradient at the hook


def test_autograd_grad_keeps_the_whole_gradient(table):
    """torch.autograd.grad accumulates into no parameter: nothing is handed off, the returned gradient is whole."""
    ids = torch.randint(11, (9,))
    (want,) = torch.autograd.grad(tied_loss(table, table, ids), [table])
    received = []
    set_receiver(table, received.append)
    (got,) = torch.autograd.grad(tied_loss(table, handoff(table), ids), [table])
    assert not received and torch.equal(got, want)


def test_set_receiver_refuses_a_non_leaf(table):
    with pytest.raises(ValueError, match="leaf"):
        set_receiver(table * 2, print)


@pytest.mark.parametrize("return_logits", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_gradients_take_the_tied_head_part_early_with_the_same_sums(gpt_config, return_logits, dtype):
    """A tied LeanGPT, two micro-batches: HostGradients gets the table's gradient in two parts (one write more per
    backward than parameters) and its buffers equal the float32 sums of what plain autograd leaves in ``.grad``."""
    model = LeanGPTForCausalLM(gpt_config()).to(dtype)
    twin = copy.deepcopy(model)
    data = [torch.randint(61, (2, 16)) for _ in range(2)]
    expected = [torch.zeros(param.shape) for param in model.parameters()]
    for input_ids in data:
        model.zero_grad()
        model(input_ids=input_ids, labels=input_ids, return_logits=return_logits).loss.backward()
        for total, param in zip(expected, model.parameters()):
            total.add_(param.grad)
    grads = HostGradients(list(twin.parameters()))
    for input_ids in data:
        twin(input_ids=input_ids, labels=input_ids, return_logits=return_logits).loss.backward()
    grads.wait()
    assert grads.writes == 2 * (len(expected) + 1)
    for total, buffer in zip(expected, grads.buffers):
        assert torch.equal(buffer, total)
    grads.remove_hooks()
    table = twin.get_input_embeddings().weight
    assert not hasattr(table, "_lean_early_grad_receiver")


def test_a_head_part_without_lookup_part_still_reaches_the_buffer(table):
    """The table's lookup has no gradient this time: the head part is added at wait()."""
    grads = HostGradients([table])
    hidden = torch.randn(5, 6)
    loss = F.cross_entropy(hidden @ handoff(table).t(), torch.randint(11, (5,)))
    (want,) = torch.autograd.grad(loss, [table], retain_graph=True)
    loss.backward()
    grads.wait()
    assert table.grad is None and torch.equal(grads.buffers[0], want)
