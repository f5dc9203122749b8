"""What the swarm code reads from a peer's settings, as protocols: any object with these attributes will do.

The command line (``arguments.py`` at the repository root) builds dataclasses that satisfy them; a program that
embeds a peer can pass its own. The library never imports the application, so it states here what it needs.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Union

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

Batch = dict[str, torch.Tensor]


class NetworkSettings(Protocol):
    """How a peer joins the swarm (every peer)."""

    run_id: str
    initial_peers: list[str]
    host_maddrs: list[str]
    announce_maddrs: list[str]
    identity_path: Optional[str]
    auth_token_path: Optional[str]
    authority_public_key_path: Optional[str]
    client_mode: bool
    use_relay: bool
    use_auto_relay: bool
    bandwidth: Optional[float]
    startup_timeout: float


class CollaborationSettings(Protocol):
    """How the peers of one run average (every peer)."""

    target_batch_size: int
    matchmaking_time: float
    averaging_timeout: float
    next_chunk_timeout: Optional[float]
    load_state_timeout: float
    average_state_every: int
    offload_optimizer: bool
    delay_optimizer_step: bool
    delay_grad_averaging: bool
    reuse_grad_buffers: bool
    grad_compression: str
    state_compression: str
    size_adaptive_threshold: int
    metrics_expiration: float
    local_steps: int  # 0: average gradients every step; H > 0: DiLoCo (lean_transformer.swarm.averaging.diloco)
    outer_lr: float
    outer_momentum: float
    outer_overlap: bool
    outer_compression: str  # a --grad_compression choice, or topk
    outer_topk_fraction: float


class TrainingSettings(Protocol):
    """How a trainer runs its local steps (the aux peer reads the few it shares: seed, resume, shutdown)."""

    seed: int
    device: Optional[str]
    per_device_batch_size: int
    gradient_accumulation_steps: int
    fp16: bool
    bf16: bool
    block_grad_scaling: bool  # with fp16: a gradient scale per residual block instead of one (swarm/averaging/block_scaling.py)
    model_dtype: str  # auto, bfloat16, float16 or float32
    offload_gradients: str  # auto, true or false
    checkpoint_attention_core: bool
    backward_chunks: int
    ffn_custom_grad: bool
    preserve_rng_state: bool
    output_dir: str
    backup_every_epochs: int
    keep_backups: int
    progress_every: float
    events_path: Optional[str]  # the peer's events (lean_transformer.swarm.monitoring.events); None: a default
    resume_from: Optional[str]
    shutdown_timeout: float

    def checkpointing_option(self) -> Union[bool, int]: ...

    @property
    def stop_epoch(self) -> int: ...


class AuxSettings(Protocol):
    """What the auxiliary peer does besides averaging."""

    metrics_path: str  # an aux peer's events go beside it unless its TrainingSettings.events_path is set
    history_window: int
    refresh_period: float
    checkpoint_dir: str
    checkpoint_every_epochs: int
    keep_checkpoints: int
    hub_repo_id: Optional[str]
    hub_upload_interval: float
    hub_public: bool
    upload_training_state: bool
    eval_batches: int
    wandb_project: Optional[str]
    wandb_dir: Optional[str]
    assist_in_averaging: bool
    assist_refresh_period: float


class Batcher(Protocol):
    def next_batch(self, batch_size: int, sequence_length: int) -> Batch:
        """The next ``batch_size`` samples, at most ``sequence_length`` tokens long, as model keyword arguments."""


class TrainingTask(Protocol):
    """One training objective as the swarm sees it: the model, this peer's batches, the optimizer and schedule."""

    config: PretrainedConfig

    def build_model(self) -> PreTrainedModel:
        """A freshly initialized model, the same on every peer."""

    def batches(self, seed: int) -> Batcher:
        """This peer's stream of training batches; ``seed`` differs between peers."""

    def validation_batches(self, count: int) -> list[Batch]:
        """``count`` batches of held-out data that no trainer's ``batches`` ever yields, the same on every call."""

    def save_tokenizer(self, directory: str) -> None:
        """Write the tokenizer into a checkpoint directory, loadable with ``AutoTokenizer.from_pretrained``."""

    def sequence_length(self, epoch: int) -> int:
        """The sequence length to train on at a swarm epoch."""

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The optimizer's parameter groups."""

    def optimizer_factory(self) -> Callable[[list[dict]], torch.optim.Optimizer]:
        """Builds the (CPU) optimizer from parameter groups."""

    def scheduler_factory(self) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]:
        """Builds the LR schedule, stepped once per swarm epoch."""


