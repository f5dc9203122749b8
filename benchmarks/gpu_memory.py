"""GPU memory of a trainer step (forward, backward and the offloaded optimizer's step) for LeanGPT 125M..2.7B under
each memory option, against today's trainer; and the host RAM per parameter of the offloaded path.

Rows, each adding to the one before (4 x 2048 tokens per micro-batch, vocab 50304, tied embeddings, rotary):

- baseline, today's trainer: float32 weights under bf16 autocast, hivemind's gradient accumulators on the device
  beside the ``.grad`` buffers, float32 logits for the loss;
- bf16 weights (``--model_dtype bfloat16``): weights, gradients and accumulators in bfloat16;
- + grad offload: gradients leave the device during backward (``HostGradients``), no device accumulators;
- + checkpointing: ``gradient_checkpointing=True`` (one checkpoint per layer);
- + chunked loss: ``model(..., labels=..., return_logits=False)``, the model library's linear + cross-entropy a chunk
  of tokens at a time (``modules/fused_loss.py``; liger-kernel's fused kernel where it is installed on CUDA), so the
  full logits never exist;
- + backward chunks: ``set_optimizations(backward_chunks=4)`` (``--backward_chunks 4``), the feed-forward's backward
  over 4 chunks of tokens.

With grad offload, the tied embedding's output-head gradient leaves as soon as the loss's backward makes it
(``modules/early_grad.py``, as ``HostGradients`` takes it), not at the end of backward.

ESTIMATED without CUDA: the model runs on fake tensors (``FakeTensorMode``) on the CPU device with the GPU's dtypes,
under ``torch.distributed._tools.mem_tracker.MemTracker``, whose peak counts every live tensor (parameters,
gradients, activations, temporaries); the optimizer step is modelled as weights (+ device accumulators) + one float32
temporary of the largest parameter (hivemind copies each float32 master weight into a bfloat16 parameter through
such a temporary). The estimate frees each gradient at its hook; on a GPU it lives until its host copy is done.
CPU kernels may keep other temporaries than CUDA's (attention: CPU flash kernel vs CUDA flash). With CUDA, the same
rows are MEASURED (``torch.cuda.max_memory_allocated`` over a whole trainer step: a 1-peer hivemind.Optimizer with
8-bit LAMB offloaded, as the trainer builds it) and printed beside the estimate with their ratio.

Usage: python benchmarks/gpu_memory.py [--sizes 125M 350M 1.3B 2.7B] [--options 0 1 ...] [--skip-largest] [--skip-host]
       [--loss auto|liger|ours] [--phases]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import transformers

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from lean_transformer.modules.early_grad import set_receiver

GiB = 2 ** 30
VOCAB, BATCH, SEQ = 50304, 4, 2048
GPU_GPT = json.loads((Path(__file__).resolve().parents[1] / "tasks" / "configs" / "gpu_gpt.json").read_text())
SIZES = {  # name: hidden, layers, heads (1.3B is tasks/configs/gpu_gpt.json)
    "125M": (768, 12, 12),
    "350M": (1024, 24, 16),
    "1.3B": (GPU_GPT["hidden_size"], GPU_GPT["num_hidden_layers"], GPU_GPT["num_attention_heads"]),
    "2.7B": (2560, 32, 32),
}
TARGETS = {"1.3B": "<= 4 GiB", "2.7B": "<= 8 GiB"}


@dataclass(frozen=True)
class Option:
    name: str
    dtype: torch.dtype = torch.bfloat16
    accumulators: bool = False  # hivemind's device accumulators (+ .grad buffers kept through backward)
    offload: bool = False  # HostGradients: each gradient leaves the device at its hook
    checkpointing: bool = False
    chunked_loss: bool = False
    backward_chunks: int = 1


OPTIONS = [
    Option("today's trainer: fp32 weights + bf16 autocast + device grad accumulators + fp32 logits (baseline)",
           dtype=torch.float32, accumulators=True),
    Option("bf16 weights", accumulators=True),
    Option("+ grad offload", offload=True),
    Option("+ checkpointing", offload=True, checkpointing=True),
    Option("+ chunked loss", offload=True, checkpointing=True, chunked_loss=True),
    Option("+ backward_chunks=4", offload=True, checkpointing=True, chunked_loss=True, backward_chunks=4),
]


def config(hidden: int, layers: int, heads: int) -> LeanGPTConfig:
    return LeanGPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, hidden_act="gelu_new", max_position_embeddings=SEQ,
                         position_embedding_type="rotary", hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, tie_word_embeddings=True)


def build(cfg: LeanGPTConfig, option: Option, device: str) -> LeanGPTForCausalLM:
    """The model directly in the option's dtype (fake parameters cannot be converted with .to(dtype))."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(option.dtype)
    try:
        with torch.device(device):
            model = LeanGPTForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.set_optimizations(gradient_checkpointing=option.checkpointing, backward_chunks=option.backward_chunks)
    return model.train()


def loss_function(model: LeanGPTForCausalLM, option: Option, input_ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    autocast = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=option.dtype == torch.float32)

    def compute() -> torch.Tensor:
        with autocast:
            return model(input_ids=input_ids, labels=input_ids, return_logits=not option.chunked_loss).loss
    return compute


def liger_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """liger-kernel's tokens per chunk in its fused linear cross-entropy (``fused_linear_cross_entropy_forward``):
    the chunk's logits about as large as the hidden states, rounded up to a power of two."""
    increase = -(-vocab // hidden)
    return min(tokens, 1 << (-(-tokens // increase) - 1).bit_length())


def liger_workspace(tokens: int, hidden: int, vocab: int, dtype_bytes: int = 2) -> int:
    """Bytes liger-kernel's fused linear cross-entropy holds beyond its inputs during its forward (it computes the
    gradients there and keeps them until its backward): the hidden states' gradient (tokens x hidden), the weight's
    gradient (vocab x hidden, in the weight's dtype), one chunk of logits (chunk x vocab) and the float32 per-token
    losses. The first two then are the gradients its backward hands on."""
    chunk = liger_chunk_rows(tokens, hidden, vocab)
    return dtype_bytes * (tokens * hidden + vocab * hidden + chunk * vocab) + 4 * tokens


class _LigerMemoryModel(torch.autograd.Function):
    """What liger-kernel's LigerFusedLinearCrossEntropyFunction allocates, in plain torch, for the fake-tensor
    estimate (liger-kernel runs on CUDA only): gradients computed in forward, chunk by chunk, and stored; backward
    hands them on. The loss values do not matter here (the estimate only counts bytes)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        chunk = liger_chunk_rows(tokens, hidden.shape[1], weight.shape[0])
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight)
        losses = torch.zeros(tokens, dtype=torch.float32)
        for start in range(0, tokens, chunk):
            logits = hidden[start:start + chunk] @ weight.t()  # liger's cross-entropy kernel turns it into its grad
            grad_hidden[start:start + chunk] = logits @ weight
            grad_weight.addmm_(logits.t(), hidden[start:start + chunk])
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden, grad_weight, None


def liger_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias=None, ignore_index: int = -100
               ) -> torch.Tensor:
    """Stands in for ``fused_loss.linear_cross_entropy`` in the estimate where CUDA runs liger-kernel's kernel."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    return _LigerMemoryModel.apply(hidden, weight, labels)


@contextlib.contextmanager
def patched(module, name: str, value) -> Iterator[None]:
    previous = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, previous)


def liger_on_cuda() -> bool:
    """Whether CUDA runs the chunked loss with liger-kernel's fused kernel (``modules/fused_loss.py``)."""
    from lean_transformer.modules import fused_loss
    return torch.cuda.is_available() and fused_loss.LigerFusedLinearCrossEntropyLoss is not None


def step_peak_model(model: LeanGPTForCausalLM, option: Option) -> int:
    """Device bytes during the offloaded optimizer step: weights, accumulators, one float32 conversion temporary."""
    params = list(model.parameters())
    weights = sum(param.numel() * param.element_size() for param in params)
    accumulators = weights if option.accumulators else 0
    conversion = 0 if option.dtype == torch.float32 else 4 * max(param.numel() for param in params)
    return weights + accumulators + conversion


def estimate(cfg: LeanGPTConfig, option: Option, liger: bool = False) -> tuple[int, int, int]:
    """ESTIMATED (fake tensors) peak bytes of a trainer step, weight bytes, parameter count. ``liger``: the chunked
    loss as liger-kernel allocates it (what CUDA runs where liger-kernel is installed), else as ours does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from lean_transformer.modules import embeddings

    loss = liger_loss if liger and option.chunked_loss else embeddings.linear_cross_entropy
    with FakeTensorMode(), patched(embeddings, "linear_cross_entropy", loss):
        model = build(cfg, option, "cpu")
        params = list(model.parameters())
        if option.offload:
            for param in params:  # as HostGradients: the gradient leaves the device at its hook, or before it
                param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                set_receiver(param, lambda grad: None)
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        compute = loss_function(model, option, input_ids)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            accumulators = [torch.zeros_like(param) for param in params] if option.accumulators else []
            compute().backward()
            del accumulators
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        weights = sum(param.numel() * param.element_size() for param in params)
        return max(peak, step_peak_model(model, option)), weights, sum(param.numel() for param in params)


@contextlib.contextmanager
def trainer(cfg: LeanGPTConfig, option: Option, device: str = "cuda", accumulation: int = 1, batch: int = BATCH,
            seq: int = SEQ, device_accumulation: int = 1
            ) -> Iterator[tuple[LeanGPTForCausalLM, "hivemind.Optimizer", Callable[[], None]]]:
    """The trainer as it builds itself for ``option``: a 1-peer hivemind.Optimizer with 8-bit LAMB offloaded, one
    optimizer step per ``accumulation`` micro-batches of BATCH x SEQ tokens. Yields the model, the optimizer and
    ``micro_batch()``: forward, backward and ``optimizer.step()`` (the global step on every ``accumulation``-th), and
    the loss's closure (forward only). ``device_accumulation``: gradients summed on the device before they leave it
    (``HostGradients``; with ``option.offload``)."""
    import hivemind
    from hivemind.optim.grad_averager import GradientAverager

    from lean_transformer.optim import CPULAMB8Bit
    from lean_transformer.swarm.averaging.host_grad_averager import HostGradientAverager

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    optimizer = None
    try:
        model = build(cfg, option, device)
        factory = functools.partial(HostGradientAverager, device_accumulation=device_accumulation)
        if not option.offload:  # float32 averaged gradients: an offloaded optimizer takes them as its .grad
            factory = functools.partial(GradientAverager, averaged_grads=tuple(
                torch.zeros(param.shape).share_memory_() for param in model.parameters()))
        optimizer = hivemind.Optimizer(
            dht=dht, run_id=f"gpu_memory_{time.monotonic_ns()}", params=model.parameters(),
            optimizer=functools.partial(CPULAMB8Bit, lr=1e-4), target_batch_size=batch * accumulation,
            batch_size_per_step=batch, offload_optimizer=True, matchmaking_time=1.0, averaging_timeout=10.0,
            verbose=False, grad_averager_factory=factory)
        input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        compute = loss_function(model, option, input_ids)

        def micro_batch() -> None:
            compute().backward()
            optimizer.step()
            if not option.offload:
                optimizer.zero_grad()
        yield model, optimizer, micro_batch, compute
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


def measure(cfg: LeanGPTConfig, option: Option, steps: int = 2, phases: bool = False
            ) -> tuple[Optional[int], Optional[float], dict[str, int]]:
    """MEASURED on CUDA: peak bytes over whole trainer steps (1-peer hivemind.Optimizer, LAMB offloaded), tokens/s;
    with ``phases``, one more step's peaks in its forward, backward and optimizer step (bytes, by phase)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with trainer(cfg, option) as (model, optimizer, trainer_step, compute):
            trainer_step()  # warm-up: kernels, allocator, LAMB's numba compile
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(steps):
                trainer_step()
            torch.cuda.synchronize()
            peak, tokens = torch.cuda.max_memory_allocated(), steps * BATCH * SEQ / (time.perf_counter() - start)
            by_phase = {}
            if phases and option.offload:
                for phase, run in (("forward", compute), ("backward", None), ("optimizer step", optimizer.step)):
                    torch.cuda.reset_peak_memory_stats()
                    if run is compute:
                        loss = compute()
                    elif run is None:
                        loss.backward()
                        del loss
                        optimizer.grad_averager.host_grads.wait()
                    else:
                        run()
                    torch.cuda.synchronize()
                    by_phase[phase] = torch.cuda.max_memory_allocated()
            return peak, tokens, by_phase
    except torch.cuda.OutOfMemoryError:
        return None, None, {}
    finally:
        torch.cuda.empty_cache()


def options_table(sizes: list[str], options: list[int], liger: bool = False, phases: bool = False) -> None:
    """``liger``: the chunked loss is liger-kernel's (estimated with its memory model; measured as CUDA runs it),
    else ours (on CUDA too)."""
    from lean_transformer.modules import fused_loss

    cuda = torch.cuda.is_available()
    where = f"MEASURED on {torch.cuda.get_device_name()} beside the ESTIMATE" if cuda else "ESTIMATED (no CUDA)"
    loss = "liger-kernel's" if liger else "ours"
    print(f"\nTrainer-step peak GPU memory, GiB, {BATCH} x {SEQ} tokens per micro-batch; {where}; chunked loss: "
          f"{loss}\n")
    header = "| model | option | weights | estimated peak | vs baseline |"
    header += " measured peak | measured / estimated | tokens/s |" if cuda else ""
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for size in sizes:
        cfg = config(*SIZES[size])
        baseline = None
        for option in (OPTIONS[i] for i in options):
            started = time.perf_counter()
            peak, weights, count = estimate(cfg, option, liger=liger)
            baseline = baseline or peak
            row = (f"| {size} ({count / 1e9:.2f}B) | {option.name} | {weights / GiB:.2f} | {peak / GiB:.2f} | "
                   f"{peak / baseline:.2f}x |")
            if cuda:
                try:
                    with contextlib.ExitStack() as stack:
                        if not liger:  # our chunked loss on CUDA too
                            stack.enter_context(patched(fused_loss, "LigerFusedLinearCrossEntropyLoss", None))
                        measured, tokens, by_phase = measure(cfg, option, phases=phases)
                    if by_phase:
                        print("  peak by phase (GiB): " + ", ".join(
                            f"{phase} {value / GiB:.3f}" for phase, value in by_phase.items()), file=sys.stderr)
                    row += (" OOM | | |" if measured is None
                            else f" {measured / GiB:.2f} | {measured / peak:.2f} | {tokens:.0f} |")
                except Exception as error:  # one broken row must not hide the others
                    row += f" failed: {type(error).__name__}: {str(error)[:80]} | | |"
            print(row, flush=True)
            print(f"  ({size}, {option.name[:20]}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
        print(f"| {size} | target for the last row | | {TARGETS.get(size, '')} | |" + (" | | |" if cuda else ""))


def beyond_weights(options: list[int], size: str = "1.3B") -> None:
    """Forward + backward memory beyond weights (+ gradients, here none on the device), bf16, checkpointing."""
    print(f"\n{size}, bf16, {BATCH} x {SEQ}, checkpointing, grad offload: ESTIMATED peak minus weights "
          f"(target <= 1.5 GiB)\n")
    print("| option | forward + backward beyond weights (GiB) |")
    print("| --- | --- |")
    for option in (OPTIONS[i] for i in options if i >= 3):
        peak, weights, _ = estimate(config(*SIZES[size]), option)
        print(f"| {option.name} | "
              f"{(peak - weights) / GiB:.2f} |", flush=True)


def largest_in(budget_gib: float = 24.0) -> None:
    """ESTIMATED: the largest LeanGPT (d=4096, 32 heads, growing depth) whose trainer step fits in the budget."""
    best = OPTIONS[-1]
    print(f"\nLargest LeanGPT in {budget_gib:.0f} GiB, ESTIMATED, all options ({best.name}); goal >= 8B\n")
    print("| hidden x layers | parameters | estimated peak (GiB) | fits |")
    print("| --- | --- | --- | --- |")
    for layers in (40, 44, 48, 52):
        peak, _, count = estimate(config(4096, layers, 32), best)
        fits = "yes" if peak <= budget_gib * GiB else "no"
        print(f"| 4096 x {layers} | {count / 1e9:.2f}B | {peak / GiB:.2f} | {fits} |", flush=True)


def host_bytes() -> None:
    """COUNTED: host bytes per parameter that a 1-peer hivemind.Optimizer (offloaded 8-bit LAMB) holds, with
    hivemind's accumulators and with host gradients. A CPU model here, so no pinned staging: on CUDA,
    HostGradients adds 2 slots of the largest gradient (for 1.3B in bf16: 2 x 206 MB = 0.31 bytes/param)."""
    import hivemind

    from lean_transformer.optim import CPULAMB8Bit
    from lean_transformer.swarm.averaging.host_grad_averager import HostGradientAverager

    cfg = config(512, 8, 8)
    print("\nHost bytes per parameter (COUNTED: unique tensor storages hivemind and our classes hold; a "
          f"{sum(p.numel() for p in LeanGPTForCausalLM(cfg).parameters()) / 1e6:.0f}M-parameter LeanGPT on the CPU;"
          " target <= 12)\n")
    print("| path | master weights | LAMB state | gradient buffers | device-side accumulators | total host |")
    print("| --- | --- | --- | --- | --- | --- |")
    for host in (False, True):
        model = LeanGPTForCausalLM(cfg)
        count = sum(param.numel() for param in model.parameters())
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        optimizer = hivemind.Optimizer(
            dht=dht, run_id=f"host_bytes_{host}", params=model.parameters(),
            optimizer=functools.partial(CPULAMB8Bit, lr=1e-4), target_batch_size=2, batch_size_per_step=2,
            offload_optimizer=True, matchmaking_time=1.0, averaging_timeout=10.0, verbose=False,
            grad_averager_factory=HostGradientAverager if host else None)
        input_ids = torch.randint(0, VOCAB, (2, 64))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        inner = optimizer.state_averager.optimizer
        masters = [param for group in inner.param_groups for param in group["params"]]
        state = [value for per_param in inner.state.values() for value in per_param.values()
                 if isinstance(value, torch.Tensor)]
        grads = [param.grad for param in masters] + list(optimizer.grad_averager._averaged_tensors)
        accumulators = list(optimizer.grad_averager._local_accumulators or ())
        figures = [unique_bytes(tensors) / count for tensors in (masters, state, grads, accumulators)]
        name = "host gradients (HostGradientAverager)" if host else "hivemind accumulators (baseline)"
        print(f"| {name} | " + " | ".join(f"{figure:.2f}" for figure in figures) +
              f" | {sum(figures[:3]):.2f} |", flush=True)
        optimizer.shutdown()
        dht.shutdown()


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--skip-largest", action="store_true", help="skip the 24 GiB search (slowest part)")
    parser.add_argument("--skip-host", action="store_true", help="skip the host bytes count (starts hivemind)")
    parser.add_argument("--options", nargs="+", type=int, default=list(range(len(OPTIONS))),
                        choices=range(len(OPTIONS)), help="rows to run, by index (0: baseline; default: all; "
                        "'vs baseline' is then against the first row run)")
    parser.add_argument("--loss", choices=["auto", "liger", "ours"], default="auto",
                        help="the chunked loss to estimate and measure: liger-kernel's (auto: where CUDA has it) or "
                             "ours (also on CUDA)")
    parser.add_argument("--phases", action="store_true", help="also print each measured row's peak by phase")
    args = parser.parse_args()
    if args.loss == "liger" and torch.cuda.is_available() and not liger_on_cuda():
        parser.error("--loss liger: liger-kernel is not installed (pip install liger-kernel)")
    liger = args.loss == "liger" or (args.loss == "auto" and liger_on_cuda())
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    options_table(args.sizes, args.options, liger=liger, phases=args.phases)
    beyond_weights(args.options)
    if not args.skip_largest:
        largest_in()
    if not args.skip_host:
        host_bytes()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
