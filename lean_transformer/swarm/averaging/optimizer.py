"""``hivemind.Optimizer`` built from the collaboration arguments and a task (its param groups, LAMB factory and LR
schedule), for trainers and, with ``auxiliary=True``, for peers that only help averaging. Its averagers are
hivemind's, safe to cancel (:mod:`lean_transformer.swarm.hivemind_fixes.averagers`); in an authorized swarm they serve token
holders only (:mod:`lean_transformer.swarm.auth.averaging_gate`)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import hivemind
import torch
from hivemind.compression import (BlockwiseQuantization, CompressionBase, CompressionInfo, Float16Compression,
                                  NoCompression, Quantile8BitQuantization, ScaledFloat16Compression,
                                  SizeAdaptiveCompression, TensorRole, Uniform8BitQuantization)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from torch import nn

from lean_transformer.swarm.auth.keys import load_public_key
from lean_transformer.swarm.averaging.diloco import NEVER, DiLoCoOptimizer, OuterLoop, OuterNesterov, PseudoGradientAverager
from lean_transformer.swarm.hivemind_fixes.averagers import GradientAverager, TrainingStateAverager, with_averagers
from lean_transformer.swarm.averaging.host_grad_averager import HostGatedGradientAverager, HostGradientAverager
from lean_transformer.swarm.auth.averaging_gate import (AveragingGate, GatedGradientAverager, GatedTrainingStateAverager,
                                                   publish_access_token)

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import (CollaborationSettings, NetworkSettings, TrainingSettings,
                                                 TrainingTask)


def make_compression(name: str, size_adaptive_threshold: int = 2**16) -> CompressionBase:
    """The hivemind compression for a ``--grad_compression`` / ``--state_compression`` choice."""
    simple = dict(none=NoCompression, float16=Float16Compression, scaled_float16=ScaledFloat16Compression,
                  uniform8bit=Uniform8BitQuantization, quantile8bit=Quantile8BitQuantization,
                  blockwise8bit=BlockwiseQuantization)
    if name == "size_adaptive":
        return SizeAdaptiveCompression(size_adaptive_threshold, less=Float16Compression(),
                                       greater_equal=Uniform8BitQuantization())
    if name not in simple:
        raise ValueError(f"unknown compression {name!r}, choose one of size_adaptive, {', '.join(simple)}")
    return simple[name]()


class ParametersOnly(AdaptiveCompressionBase):
    """Compresses the state's float parameters and sends everything else as it is. The optimizer statistics must
    arrive exactly: the 8-bit (uint8) LAMB codes are refused or mangled by hivemind's float16 and 8-bit codecs, and
    the float32 second moments of small tensors (~1e-8 and below) flush to zero in float16."""

    def __init__(self, compression: CompressionBase):
        self.compression = compression

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        floats = info.descriptor.dtype in (torch.float32, torch.float16)
        return self.compression if floats and info.role == TensorRole.PARAMETER else NoCompression()


def build_optimizer(dht: hivemind.DHT, model: nn.Module, task: TrainingTask, network: NetworkSettings,
                    collaboration: CollaborationSettings, training: TrainingSettings, private_key: RSAPrivateKey,
                    *, auxiliary: bool = False, host_gradients: bool = False,
                    optimizer_class: type[hivemind.Optimizer] = hivemind.Optimizer) -> hivemind.Optimizer:
    """Wrap the task's LAMB and LR schedule in a hivemind.Optimizer that averages with the run's peers.

    ``private_key`` owns the progress records (the same key as the metrics records). With --fp16, gradients are
    accumulated in the model's .grad buffers, because hivemind's GradScaler unscales exactly those (not with
    --block_grad_scaling, which unscales every local step: then as --reuse_grad_buffers says).
    ``optimizer_class`` lets the aux peer use its ``hivemind.Optimizer`` subclass. With --auth_token_path, this peer's
    token is published first (its averaging partners look it up) and the class gets gated averagers. With
    ``host_gradients``, the model's gradients leave the device during backward into the gradient averager's host
    buffers (:mod:`lean_transformer.swarm.averaging.host_grad_averager`; needs ``offload_optimizer``, no delays), or with
    --local_steps into the offloaded optimizer's (``DiLoCoOptimizer.attach_host_gradients``).
    """
    averager_opts = averager_options(network, collaboration)
    gated = network.auth_token_path is not None
    if gated:
        averager_opts["gate"] = open_averaging_gate(dht, network, private_key)
    gradient_averager = gradient_averager_class(gated, host_gradients and collaboration.local_steps == 0)
    state_averager = GatedTrainingStateAverager if gated else TrainingStateAverager
    optimizer_class = with_averagers(optimizer_class, gradient_averager, state_averager)
    params = task.param_groups(model)
    diloco: dict = {}
    outer = None
    if collaboration.local_steps > 0:
        outer = OuterNesterov([param for group in params for param in group["params"]], lr=collaboration.outer_lr,
                              momentum=collaboration.outer_momentum)
        optimizer_class = with_diloco(optimizer_class)
        diloco = dict(use_local_updates=True, extra_tensors=outer.state_tensors(), average_state_every=NEVER)
    state_compression = ParametersOnly(make_compression(collaboration.state_compression,
                                                    collaboration.size_adaptive_threshold))
    optimizer = optimizer_class(
        dht=dht,
        run_id=network.run_id,
        target_batch_size=collaboration.target_batch_size * max(1, collaboration.local_steps),
        batch_size_per_step=(None if auxiliary
                             else training.per_device_batch_size * training.gradient_accumulation_steps),
        params=params,
        optimizer=task.optimizer_factory(),
        scheduler=task.scheduler_factory(),
        matchmaking_time=collaboration.matchmaking_time,
        averaging_timeout=collaboration.averaging_timeout,
        next_chunk_timeout=collaboration.next_chunk_timeout,
        load_state_timeout=collaboration.load_state_timeout,
        average_state_every=diloco.pop("average_state_every", collaboration.average_state_every),
        offload_optimizer=collaboration.offload_optimizer,
        delay_optimizer_step=collaboration.delay_optimizer_step,
        delay_grad_averaging=collaboration.delay_grad_averaging,
        reuse_grad_buffers=collaboration.reuse_grad_buffers or (training.fp16 and not training.block_grad_scaling),
        client_mode=network.client_mode,
        auxiliary=auxiliary,
        grad_compression=make_compression(collaboration.grad_compression, collaboration.size_adaptive_threshold),
        state_averaging_compression=state_compression,
        load_state_compression=state_compression,
        averager_opts=averager_opts,
        tracker_opts=dict(private_key=private_key),
        verbose=True,
        **diloco,
    )
    if outer is not None:
        averager = build_outer_averager(dht, network, collaboration, outer, averager_opts, auxiliary=auxiliary)
        optimizer.attach_outer_loop(OuterLoop(outer, averager, overlap=collaboration.outer_overlap),
                                    collaboration.local_steps)
        if host_gradients:
            optimizer.attach_host_gradients()
    return optimizer


def gradient_averager_class(gated: bool, host_gradients: bool) -> type[GradientAverager]:
    """The gradient averager: serving token holders only (``gated``), accumulating on the host (``host_gradients``).
    hivemind names an averager's RPCs after its class, so each combination is a class of its own."""
    if host_gradients:
        return HostGatedGradientAverager if gated else HostGradientAverager
    return GatedGradientAverager if gated else GradientAverager


@functools.cache
def with_diloco(optimizer_class: type[hivemind.Optimizer]) -> type[hivemind.Optimizer]:
    """``optimizer_class`` running DiLoCo's outer loop (:class:`lean_transformer.swarm.averaging.diloco.DiLoCoOptimizer`)."""
    return type(optimizer_class.__name__, (DiLoCoOptimizer, optimizer_class), {})


def build_outer_averager(dht: hivemind.DHT, network: NetworkSettings, collaboration: CollaborationSettings,
                         outer: OuterNesterov, averager_opts: dict, *, auxiliary: bool) -> PseudoGradientAverager:
    """The pseudo-gradient all-reduce of ``--local_steps`` mode: ``--outer_compression`` (a hivemind codec, or top-k
    with error feedback), the averaging gate of an authorized swarm, aux peers joining without a pseudo-gradient."""
    shapes = [anchor.shape for anchor in outer.anchor]
    topk_fraction, compression = None, NoCompression()
    if collaboration.outer_compression == "topk":
        topk_fraction = collaboration.outer_topk_fraction
    else:
        compression = make_compression(collaboration.outer_compression, collaboration.size_adaptive_threshold)
    return PseudoGradientAverager(dht, f"{network.run_id}_outer", shapes,
                                  matchmaking_time=collaboration.matchmaking_time,
                                  allreduce_timeout=collaboration.averaging_timeout, compression=compression,
                                  topk_fraction=topk_fraction, client_mode=network.client_mode, auxiliary=auxiliary,
                                  **averager_opts)


def open_averaging_gate(dht: hivemind.DHT, network: NetworkSettings, private_key: RSAPrivateKey) -> AveragingGate:
    """Publish this peer's access token under its peer ID and return the gate for its averagers. ``private_key``
    must be the DHT's signature validator key, which owns the token's record (as with the metrics records)."""
    authority_public_key = load_public_key(network.authority_public_key_path, "authority public key file")
    owner = RSASignatureValidator(private_key).local_public_key
    publish_access_token(dht, network.run_id, network.auth_token_path, owner)
    return AveragingGate(dht, network.run_id, authority_public_key)


def averager_options(network: NetworkSettings, collaboration: CollaborationSettings) -> dict:
    """Options of hivemind's averagers. Matchmaking requests must time out well within the matchmaking window:
    with hivemind's default (3 s) at or above a short --matchmaking_time, two peers that both wait for the other
    to answer can deadlock and miss every gradient-averaging round (seen on loopback with matchmaking_time=3)."""
    options: dict = dict(request_timeout=min(3.0, collaboration.matchmaking_time / 2))
    if network.bandwidth is not None:
        options["bandwidth"] = network.bandwidth
    return options
