"""fp16 training of a deep tiny network whose blocks' gradients span more than fp16's range: one global loss scale
(``torch.amp.GradScaler``, the baseline) against per-block scales (``BlockGradScaler``), with fp32 as the reference.

The network: residual MLP blocks on an fp32 residual stream, fitting a random teacher with Adam. Block k's inner
gradients are multiplied by ``gain_k`` in backward (2^-32 for five blocks, then 1, 2^12, 2^16; forward unchanged,
the stream's gradient unchanged): a stand-in for the drift of gradient magnitudes across depth that DALL-E met. Adam
with an epsilon below every gradient is invariant to it, so fp32 training is the same for every gain. Per-block
scales start at 2^32 and only shrink (no growth in so short a run). Writes the loss curves to
``<out>/grad_scaling.png`` and prints a table.

Usage: python benchmarks/grad_scaling.py [--steps 400 --out outputs/benchmarks]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from lean_transformer.optim.block_grad_scaler import BlockGradScaler

GAINS = [2.0 ** -32] * 5 + [1.0, 2.0 ** 12, 2.0 ** 16]  # a 2^48 spread; fp16 spans 2^40 (with subnormals)


class _GradGain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: float) -> torch.Tensor:
        ctx.gain = gain
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.gain, None


class GainBlock(nn.Module):
    """A residual MLP block whose inner gradients are ``gain`` times those of the plain block (forward unchanged,
    the residual stream's gradient unchanged): a stand-in for the drift of gradient magnitudes across the depth of
    deep networks. Adam with an epsilon below every gradient is invariant to it, so fp32 training is unaffected."""

    def __init__(self, width: int, gain: float):
        super().__init__()
        self.norm, self.dense_in = nn.LayerNorm(width), nn.Linear(width, 4 * width)
        self.dense_out = nn.Linear(4 * width, width)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _GradGain.apply(x, 1 / self.gain)  # the stream's gradient stays as it is
        return _GradGain.apply(self.dense_out(F.relu(self.dense_in(self.norm(x)))), self.gain)


class DeepNet(nn.Module):
    def __init__(self, width: int, gains: list[float]):
        super().__init__()
        self.blocks = nn.ModuleList(GainBlock(width, gain) for gain in gains)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train(mode: str, steps: int, width: int) -> dict:
    torch.manual_seed(0)
    teacher = DeepNet(width, [1.0] * len(GAINS))
    inputs = torch.randn(2048, width)
    with torch.no_grad():
        for param in teacher.parameters():
            param.mul_(3)  # a target the student's blocks must all work to fit
        targets = teacher(inputs)
    torch.manual_seed(1)
    model = DeepNet(width, GAINS)
    initial = [block.dense_out.weight.detach().clone() for block in model.blocks]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-30)  # eps below every gradient: gain-invariant
    block_scaler = (BlockGradScaler(list(model.blocks), other_params=model.head.parameters(), init_scale=2.0 ** 32,
                                    max_scale=2.0 ** 32, growth_interval=10 ** 6)
                    if mode == "per-block" else None)
    grad_scaler = torch.amp.GradScaler("cpu", growth_interval=10 ** 6) if mode == "global" else None
    losses, skipped_steps, skipped_updates, last_skip = [], 0, 0, None
    for step in range(steps):
        batch = torch.randint(0, len(inputs), (64,))
        with torch.autocast("cpu", dtype=torch.float16, enabled=mode != "fp32"):
            loss = F.mse_loss(model(inputs[batch]).float(), targets[batch])
        optimizer.zero_grad()
        if block_scaler is not None:
            loss.backward()
            block_scaler.step(optimizer)
            block_scaler.update()
            skipped_steps += block_scaler.skipped_blocks > 0
            last_skip = step if block_scaler.skipped_blocks else last_skip
            skipped_updates += block_scaler.skipped_blocks
        elif grad_scaler is not None:
            scale = grad_scaler.get_scale()
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            skipped = grad_scaler.get_scale() < scale
            skipped_steps += skipped
            last_skip = step if skipped else last_skip
            skipped_updates += skipped * len(GAINS)
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    frozen = sum(bool((block.dense_out.weight == w).all()) for block, w in zip(model.blocks, initial))
    return dict(losses=losses, skipped_steps=skipped_steps, skipped_updates=skipped_updates, frozen=frozen,
                last_skip=last_skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {mode: train(mode, args.steps, args.width) for mode in ("fp32", "global", "per-block")}

    def final(mode: str) -> float:
        tail = runs[mode]["losses"][-50:]
        return sum(tail) / len(tail)

    print(f"Deep tiny network, {len(GAINS)} blocks with inner gradient gains 2^-32 (5 blocks), 1, 2^12, 2^16, "
          f"{args.steps} Adam steps, "
          f"batch 64; loss = mean of the last 50 steps\n")
    print("| training | final loss | vs fp32 | steps with a skip (last one) | skipped block updates "
          "| blocks never updated |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, name in (("fp32", "fp32 (reference)"), ("global", "fp16, one GradScaler scale (baseline)"),
                       ("per-block", "fp16, BlockGradScaler")):
        run = runs[mode]
        print(f"| {name} | {final(mode):.2f} | {final(mode) / final('fp32'):.3f}x | "
              f"{run['skipped_steps']} ({'-' if run['last_skip'] is None else run['last_skip']}) | "
              f"{run['skipped_updates']} of {args.steps * len(GAINS)} | {run['frozen']} of {len(GAINS)} |")

    args.out.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(7, 4))
    axis = figure.add_subplot()
    for mode, name in (("fp32", "fp32"), ("global", "fp16, one scale (GradScaler)"),
                       ("per-block", "fp16, per-block scales")):
        axis.plot(runs[mode]["losses"], label=name, linewidth=1)
    axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.set_ylabel("MSE loss")
    axis.set_title("fp16 gradient scaling, blocks' gradients spanning 2^48")
    axis.legend()
    figure.tight_layout()
    path = args.out / "grad_scaling.png"
    FigureCanvasAgg(figure).print_png(str(path))
    print(f"\nloss curves: {path}")


if __name__ == "__main__":
    main()
