"""The settings a peer runs with, declared once: every field is a command-line flag (its name, default, help and
check live here), and the fields marked ``agree`` are the run settings every peer of one swarm must share (checked
by :mod:`.agreement`; :func:`agreed_settings` collects them). ``arguments.py`` at the repository root builds the
command line from these dataclasses and adds the application's own (the task); a program that embeds a peer builds
them directly. Each dataclass checks its values on construction and raises ``ValueError`` naming the flag.

Importing this module is cheap (no torch, transformers or hivemind), so that parsing flags is: only a multiaddr that
is given is checked with hivemind's parser, which loads hivemind.

Also here: the task interface the swarm code needs (:class:`TrainingTask`), as protocols.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Protocol, Sequence, Union

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

Batch = dict[str, "torch.Tensor"]

Compression = Literal["size_adaptive", "none", "float16", "scaled_float16", "uniform8bit", "quantile8bit",
                      "blockwise8bit"]
OuterCompression = Literal["size_adaptive", "none", "float16", "scaled_float16", "uniform8bit", "quantile8bit",
                           "blockwise8bit", "topk"]
Aggregation = Literal["mean", "centered_clip"]

_RUN_ID = re.compile(r"[A-Za-z0-9_.\-]+")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*")


DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
HISTORY_ROUNDS = 4  # DiLoCo: outer steps a peer's history keeps, and a peer catches up on at most (outer_history.py)


def require(condition: bool, flag: str, message: str) -> None:
    """Raise ``ValueError("--flag: message")`` unless ``condition``."""
    if not condition:
        raise ValueError(f"--{flag}: {message}")


def validate_run_id(run_id: str) -> None:
    require(bool(_RUN_ID.fullmatch(run_id or "")), "run_id",
            f"{run_id!r} must be non-empty and use only letters, digits, '_', '-' and '.'")


def validate_maddrs(maddrs: Sequence[str], flag: str, *, require_peer_id: bool = False) -> None:
    """Raise ValueError naming ``--flag`` for the first string that is not a usable multiaddr (hivemind's parser,
    loaded only when there is an address to check)."""
    if not maddrs:
        return
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
        except Exception as e:  # the multiaddr package raises several unrelated exception types
            raise ValueError(f"--{flag}: {maddr!r} is not a valid multiaddr ({e})") from None
        if require_peer_id:
            if "p2p" not in {protocol.name for protocol in parsed.protocols()}:
                raise ValueError(f"--{flag}: {maddr!r} has no /p2p/<peer id> part; copy the full address that the "
                                 f"peer printed after --initial_peers")
            try:
                PeerID.from_base58(parsed.value_for_protocol("p2p"))
            except Exception:
                raise ValueError(f"--{flag}: {maddr!r} has a malformed peer id") from None


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text))


def is_hub_repo_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub repo id (``owner/name``) rather than a local path (one that does not exist)."""
    return looks_like_repo_id(text) and not os.path.exists(text)


def agreed_settings(*groups: Any) -> dict[str, Any]:
    """The values of the fields marked ``agree`` in ``groups`` (settings dataclasses), named by flag."""
    return {item.name: getattr(group, item.name) for group in groups for item in dataclasses.fields(group)
            if item.metadata.get("agree")}


@dataclass
class NetworkSettings:
    """How this peer joins the swarm: who it talks to and how others reach it."""

    _argument_group_name = "network (every peer)"

    run_id: str = field(metadata={"help": "Name of the training run; every peer of one swarm uses the same run_id. "
                                          "It prefixes all DHT keys (letters, digits, '_', '-', '.')."})
    initial_peers: list[str] = field(default_factory=list, metadata={
        "help": "Multiaddrs of peers already in the swarm, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... "
                "(copy the --initial_peers line another peer printed). Empty: start a new swarm."})
    host_maddrs: list[str] = field(default_factory=lambda: list(DEFAULT_HOST_MADDRS), metadata={
        "help": "Multiaddrs to listen on. Use a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) for a stable address."})
    announce_maddrs: list[str] = field(default_factory=list, metadata={
        "help": "Multiaddrs other peers should use to reach this one (e.g. your public IP and port), "
                "if they differ from the listening ones."})
    identity_path: Optional[str] = field(default=None, metadata={
        "help": "File with this peer's private key; created if missing. Keeps the peer ID (and so the address "
                "printed for --initial_peers) the same across restarts."})
    auth_token_path: Optional[str] = field(default=None, metadata={
        "help": "Access token the swarm owner issued for this peer's --identity_path key (authorized swarms only; "
                "see `python -m lean_transformer.swarm.auth --help`)."})
    authority_public_key_path: Optional[str] = field(default=None, metadata={
        "help": "The swarm authority's public key: with --auth_token_path, talk only to peers holding its tokens."})
    client_mode: bool = field(default=False, metadata={
        "help": "Do not accept incoming connections (for peers behind NAT or a firewall). Client peers still "
                "train and average through full peers."})
    use_relay: bool = field(default=True, metadata={
        "help": "Allow reaching peers behind NAT through libp2p circuit relays."})
    use_auto_relay: bool = field(default=False, metadata={
        "help": "Look for relays to become reachable when this peer is behind NAT."})
    bandwidth: Optional[float] = field(default=None, metadata={
        "help": "This peer's network bandwidth in Mbit/s; all-reduce gives faster peers a larger share of the work."})
    startup_timeout: float = field(default=30.0, metadata={
        "help": "Seconds to wait for the DHT to start and reach --initial_peers before giving up with an error."})

    def __post_init__(self):
        validate_run_id(self.run_id)
        validate_maddrs(self.initial_peers, "initial_peers", require_peer_id=True)
        validate_maddrs([] if self.host_maddrs == list(DEFAULT_HOST_MADDRS) else self.host_maddrs, "host_maddrs")
        validate_maddrs(self.announce_maddrs, "announce_maddrs")
        require(self.bandwidth is None or self.bandwidth > 0, "bandwidth", f"must be positive, got {self.bandwidth}")
        require(self.startup_timeout > 0, "startup_timeout", f"must be positive, got {self.startup_timeout}")
        if self.identity_path is not None:
            parent = os.path.dirname(os.path.abspath(self.identity_path))
            require(os.path.isdir(parent), "identity_path", f"directory {parent} does not exist")


@dataclass
class CollaborationSettings:
    """How the peers of one run average: these must agree across the swarm (except the offload/delay options)."""

    _argument_group_name = "collaboration (every peer)"

    target_batch_size: int = field(default=4096, metadata={"agree": True,
        "help": "Samples the whole swarm accumulates per optimizer step (one 'epoch' in hivemind's terms)."})
    matchmaking_time: float = field(default=15.0, metadata={
        "help": "Seconds to wait for peers to join an averaging group (3-5 on a LAN, 10-15 over the internet)."})
    averaging_timeout: float = field(default=60.0, metadata={
        "help": "Cancel an averaging round that takes longer than this many seconds and go on with local state."})
    next_chunk_timeout: Optional[float] = field(default=None, metadata={
        "help": "Seconds to wait for the next chunk of a tensor in all-reduce (default: matchmaking_time); a "
                "groupmate that has not started its all-reduce yet is waited for one matchmaking_time more."})
    load_state_timeout: float = field(default=600.0, metadata={
        "help": "Seconds to wait while downloading the swarm's state from a peer."})
    # hivemind's default is 1. A parameter round moves the parameters (float32 by default: 4x an 8-bit gradient
    # round; hivemind averages no optimizer statistics unless asked), and it holds a peer's next epoch until its
    # group is done (one thread runs a peer's optimizer steps and parameter rounds, in turn): measured with 8
    # trainers on 2 cores (tests/test_large_swarm.py), gradient groups held 4.2-6.0 of 8 peers on average with a
    # parameter round every epoch, 5.8 every 4 epochs, and 6.8-8.0 without. Gradient averaging keeps a group's
    # parameters equal; these rounds only undo splits.
    average_state_every: int = field(default=10, metadata={
        "help": "Average parameters with peers every this many epochs (gradient mode); each round moves the "
                "parameters (4x an 8-bit gradient round) and delays the next epoch, so rounds are rare by default."})
    offload_optimizer: bool = field(default=True, metadata={
        "help": "Keep the optimizer and its state in host memory (saves accelerator memory)."})
    delay_optimizer_step: bool = field(default=False, metadata={
        "help": "Run the optimizer step in the background and apply it one step late (needs offload_optimizer)."})
    delay_grad_averaging: bool = field(default=False, metadata={
        "help": "Average gradients in the background, one step late (needs delay_optimizer_step)."})
    reuse_grad_buffers: bool = field(default=False, metadata={
        "help": "Accumulate gradients in the model's .grad buffers (saves memory; always on with --fp16)."})
    grad_compression: Compression = field(default="size_adaptive", metadata={"agree": True,
        "help": "How gradients are sent in all-reduce. size_adaptive: float16 for small tensors, uniform 8-bit "
                "for tensors with at least --size_adaptive_threshold elements."})
    state_compression: Compression = field(default="none", metadata={"agree": True,
        "help": "How parameters and optimizer state are sent when averaging state or loading it from peers."})
    size_adaptive_threshold: int = field(default=2**16, metadata={"agree": True,
        "help": "Tensors with at least this many elements use 8-bit compression under size_adaptive."})
    metrics_expiration: float = field(default=600.0, metadata={
        "help": "Seconds a peer's published metrics stay in the DHT; a peer silent for longer counts as gone."})
    local_steps: int = field(default=0, metadata={"agree": True,
        "help": "0: average gradients at every optimizer step. H > 0: DiLoCo; each trainer takes local 8-bit LAMB "
                "steps and the swarm averages how far the parameters moved (an outer Nesterov step) once it has "
                "processed H x --target_batch_size samples (about H local steps each when --target_batch_size is "
                "the swarm's samples per local step). Epochs then count outer rounds, the LR schedule local steps."})
    outer_lr: float = field(default=0.7, metadata={"agree": True,
        "help": "DiLoCo's outer learning rate (with --local_steps)."})
    outer_momentum: float = field(default=0.9, metadata={"agree": True,
        "help": "DiLoCo's outer Nesterov momentum (with --local_steps; 0: plain SGD)."})
    outer_overlap: bool = field(default=False, metadata={"agree": True,
        "help": "With --local_steps: average a round's pseudo-gradient in the background while the next round "
                "trains, and apply its outer step one round late."})
    outer_compression: OuterCompression = field(default="none", metadata={"agree": True,
        "help": "How pseudo-gradients are sent (with --local_steps): a --grad_compression choice, or topk (the "
                "--outer_topk_fraction largest values with error feedback, float16 values + int32 indices)."})
    outer_topk_fraction: float = field(default=0.01, metadata={"agree": True,
        "help": "Fraction of each pseudo-gradient tensor sent with --outer_compression topk."})
    # 2: rounds that split twice in a row part the branches two steps back (benchmarks/internet.py, 16 trainers)
    outer_branch_depth: int = field(default=2, metadata={
        "help": "With --outer_compression topk: outer states kept from before this peer's last outer steps (8 "
                "bytes per parameter of host memory each), so that a peer whose group averaged those rounds on "
                "another branch goes back and replays the group's steps from its history instead of downloading "
                "the whole state. 0 keeps none."})
    aggregation: Aggregation = field(default="centered_clip", metadata={"agree": True,
        "help": "How each reducer of an all-reduce combines the peers' gradients (or DiLoCo pseudo-gradients): "
                "centered_clip (BTARD's CenteredClip: a peer sending a huge wrong update moves the result by at most "
                "about its share of the weight times the honest peers' spread; honest updates get their weighted "
                "mean, each peer's weight capped at 2x the group's median), or mean (hivemind's weighted mean: one "
                "lying peer moves every model). Parameter averaging (--average_state_every) stays a mean."})

    def __post_init__(self):
        require(self.target_batch_size > 0, "target_batch_size", f"must be positive, got {self.target_batch_size}")
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout", "metrics_expiration"):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        require(self.next_chunk_timeout is None or self.next_chunk_timeout > 0, "next_chunk_timeout",
                f"must be positive, got {self.next_chunk_timeout}")
        require(self.average_state_every > 0, "average_state_every",
                f"must be positive, got {self.average_state_every}")
        require(self.size_adaptive_threshold > 0, "size_adaptive_threshold",
                f"must be positive, got {self.size_adaptive_threshold}")
        require(not self.delay_optimizer_step or self.offload_optimizer, "delay_optimizer_step",
                "needs --offload_optimizer")
        require(not self.delay_grad_averaging or self.delay_optimizer_step, "delay_grad_averaging",
                "needs --delay_optimizer_step")
        require(self.local_steps >= 0, "local_steps", f"must be non-negative, got {self.local_steps}")
        require(self.outer_lr > 0, "outer_lr", f"must be positive, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, "outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        require(0 < self.outer_topk_fraction <= 1, "outer_topk_fraction",
                f"must be in (0, 1], got {self.outer_topk_fraction}")
        require(0 <= self.outer_branch_depth <= HISTORY_ROUNDS, "outer_branch_depth",
                f"must be in [0, {HISTORY_ROUNDS}] (the outer steps a history keeps), got {self.outer_branch_depth}")
        if self.local_steps > 0:
            for name in ("delay_optimizer_step", "delay_grad_averaging", "reuse_grad_buffers"):
                require(not getattr(self, name), name, "does not apply with --local_steps (local optimizer steps)")


@dataclass
class TrainingSettings:
    """How this trainer computes gradients: batch, schedule, precision, memory options and local state."""

    _argument_group_name = "training (trainer peers)"

    per_device_batch_size: int = field(default=8, metadata={"help": "Samples per forward/backward pass."})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "Forward/backward passes accumulated locally before reporting them to the swarm."})
    learning_rate: float = field(default=2e-3, metadata={"agree": True, "help": "Peak learning rate of LAMB."})
    warmup_steps: int = field(default=100, metadata={"agree": True,
        "help": "Epochs (optimizer steps) of linear LR warmup."})
    total_steps: int = field(default=10_000, metadata={"agree": True,
        "help": "Epochs (optimizer steps) after which the LR reaches zero; training stops there too."})
    lr_schedule: Literal["linear", "cosine"] = field(default="linear", metadata={"agree": True,
        "help": "Decay of the LR after warmup."})
    weight_decay: float = field(default=0.01, metadata={"agree": True,
        "help": "Weight decay (not applied to biases and LayerNorm weights)."})
    adam_beta1: float = field(default=0.9, metadata={"agree": True,
        "help": "LAMB's beta1 (decay of the gradient's average)."})
    adam_beta2: float = field(default=0.999, metadata={"agree": True,
        "help": "LAMB's beta2 (decay of the squared gradient's average)."})
    adam_epsilon: float = field(default=1e-6, metadata={"agree": True,
        "help": "LAMB's epsilon (added to the denominator)."})
    max_grad_norm: Optional[float] = field(default=1.0, metadata={"agree": True,
        "help": "Clip the averaged gradient to this global norm (none: no clipping)."})
    clamp_value: float = field(default=10_000.0, metadata={"agree": True,
        "help": "LAMB's upper bound on the trust ratio."})
    min_8bit_size: int = field(default=4096, metadata={"agree": True,
        "help": "Optimizer statistics of tensors with at least this many elements are stored in 8 bits."})
    fp16: bool = field(default=False, metadata={
        "help": "Mixed precision with float16 and hivemind's gradient scaler (GPU)."})
    bf16: bool = field(default=False, metadata={"help": "Mixed precision with bfloat16."})
    block_grad_scaling: bool = field(default=False, metadata={
        "help": "With --fp16: one gradient scale per residual block (DALL-E's per-resblock scaling) instead of one "
                "for the whole model; a block that overflows drops out of that local step (its gradient counts as "
                "zero in the swarm's average) and halves its scale, the other blocks train on. Needs float32 weights "
                "and no host gradients (--model_dtype and --offload_gradients auto choose them). Peers with and "
                "without it average together (each sends unscaled gradients)."})
    model_dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(default="auto", metadata={
        "help": "The dtype of the weights on the device (auto: bfloat16 on a GPU that supports it when gradients "
                "go to the host, else float32). "
                "The optimizer keeps float32 master weights in host memory either way; float16 gets loss scaling. "
                "Anything but float32 needs --offload_gradients."})
    offload_gradients: Literal["auto", "true", "false"] = field(default="auto", metadata={
        "help": "Move each gradient to float32 host buffers as backward produces it, so the device never holds a "
                "whole set (auto: on a GPU, without --block_grad_scaling). Needs --offload_optimizer, without "
                "--delay_optimizer_step."})
    device_accumulation: int = field(default=1, metadata={
        "help": "With host gradients (--offload_gradients): sum this many micro-batches' gradients on the GPU in "
                "float32 (+4 bytes/param of GPU memory) before they go to the host, so the host adds N times less: "
                "for a GPU faster than the host's adds (benchmarks/host_throughput.py). 1: each micro-batch's "
                "gradients leave during its backward."})
    gradient_checkpointing: str = field(default="false", metadata={
        "help": "Recompute activations in backward: false; true (keep only each layer's input); or an integer N "
                "(split the layers into N equal segments and keep only each segment's input; 1..num_hidden_layers)."})
    checkpoint_attention_core: bool = field(default=False, metadata={
        "help": "Also recompute the attention core (saves memory on long sequences)."})
    backward_chunks: int = field(default=1, metadata={
        "help": "Run backward in N pieces (the feed-forward's backward over N chunks of tokens; in reversible models "
                "also the recomputation, attention in N head groups): less memory, same gradients."})
    ffn_custom_grad: bool = field(default=True, metadata={
        "help": "Use the hand-written, memory-saving backward pass of the feedforward layers."})
    preserve_rng_state: bool = field(default=True, metadata={
        "help": "Replay dropout exactly when recomputing checkpointed activations."})
    initial_sequence_length: Optional[int] = field(default=None, metadata={
        "help": "Sequence length at epoch 0 of the sequence-length warmup (default: max_sequence_length)."})
    max_sequence_length: int = field(default=128, metadata={"help": "Sequence length after the warmup."})
    sequence_length_warmup_steps: int = field(default=0, metadata={
        "help": "Epochs over which the sequence length grows linearly to max_sequence_length."})
    pad_to_multiple_of: int = field(default=8, metadata={
        "help": "Sequence lengths are multiples of this (faster matmuls)."})
    seed: int = field(default=0, metadata={
        "help": "Seed of the model's initialization (same on every peer); data order is seeded per peer."})
    output_dir: str = field(default="outputs/trainer", metadata={
        "help": "Local backups and the final state on exit are written here."})
    backup_every_epochs: int = field(default=10, metadata={
        "help": "Write a local backup every this many epochs (0: never); restored if parameters turn non-finite."})
    keep_backups: int = field(default=2, metadata={"help": "How many local backups to keep."})
    resume_from: Optional[str] = field(default=None, metadata={
        "help": "Checkpoint to load before joining: a checkpoint directory, a folder of them (the newest is used) "
                "or a Hugging Face Hub repo id (owner/name) that an aux peer uploaded to. The newer of it and the "
                "swarm's state wins; its optimizer state (LR schedule included) replaces this peer's, as the "
                "swarm's does."})
    max_epochs: Optional[int] = field(default=None, metadata={
        "help": "Stop once this peer reaches this epoch (default: total_steps)."})
    device: Optional[str] = field(default=None, metadata={"help": "Torch device (default: cuda if available)."})
    progress_every: float = field(default=5.0, metadata={"help": "Seconds between progress lines."})
    events_path: Optional[str] = field(default=None, metadata={
        "help": "JSON-lines file of this peer's events (epochs, averaging rounds, state downloads, shutdown), for "
                "programs; appended to (default: events.jsonl in --output_dir)."})
    shutdown_timeout: float = field(default=25.0, metadata={
        "help": "On Ctrl+C / SIGTERM, seconds to finish the current step and leave the swarm; averaging rounds "
                "still in flight after a fifth of it are cancelled, and the step is abandoned when it is spent."})

    def __post_init__(self):
        for name in ("per_device_batch_size", "gradient_accumulation_steps", "total_steps", "max_sequence_length",
                     "pad_to_multiple_of", "keep_backups", "backward_chunks", "device_accumulation"):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "sequence_length_warmup_steps", "backup_every_epochs", "weight_decay",
                     "min_8bit_size"):
            require(getattr(self, name) >= 0, name, f"must be non-negative, got {getattr(self, name)}")
        for name in ("learning_rate", "adam_epsilon", "clamp_value", "progress_every", "shutdown_timeout"):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        require(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm",
                f"must be positive, got {self.max_grad_norm}")
        require(not (self.fp16 and self.bf16), "fp16", "--fp16 and --bf16 are mutually exclusive")
        require(not self.block_grad_scaling or self.fp16, "block_grad_scaling",
                "needs --fp16 (it replaces the float16 loss scale)")
        require(not self.block_grad_scaling or self.model_dtype in ("auto", "float32"), "block_grad_scaling",
                f"needs float32 weights on the device, got --model_dtype {self.model_dtype}")
        require(not self.block_grad_scaling or self.offload_gradients != "true", "block_grad_scaling",
                "not available with --offload_gradients true (host gradients are unscaled with one scale as they "
                "leave the device)")
        require(self.device_accumulation == 1 or self.offload_gradients != "false", "device_accumulation",
                "sums host gradients on the device: not available with --offload_gradients false")
        require(self.initial_sequence_length is None or 0 < self.initial_sequence_length <= self.max_sequence_length,
                "initial_sequence_length", f"must be in [1, max_sequence_length], got {self.initial_sequence_length}")
        require(self.max_epochs is None or self.max_epochs > 0, "max_epochs",
                f"must be positive, got {self.max_epochs}")
        require(self.resume_from is None or os.path.isdir(self.resume_from) or is_hub_repo_id(self.resume_from),
                "resume_from", f"{self.resume_from} is neither a directory nor a Hub repo id (owner/name)")
        self.checkpointing_option()  # validates the string

    def checkpointing_option(self) -> Union[bool, int]:
        """``gradient_checkpointing`` as ``model.set_optimizations`` takes it: False, True (one checkpoint per
        layer) or a number of segments (the model checks it against its layer count)."""
        value = self.gradient_checkpointing.strip().lower()
        if value in ("false", "0", "no"):
            return False
        if value in ("true", "yes"):
            return True
        require(value.isdigit(), "gradient_checkpointing", f"must be false, true or an integer, got {value!r}")
        return int(value)

    @property
    def stop_epoch(self) -> int:
        return self.max_epochs if self.max_epochs is not None else self.total_steps


@dataclass
class AuxSettings:
    """What the auxiliary peer does: metrics, checkpoints, Hub upload, averaging help."""

    _argument_group_name = "auxiliary peer"

    refresh_period: float = field(default=30.0, metadata={
        "help": "Seconds between reads of the trainers' metrics from the DHT."})
    metrics_path: str = field(default="outputs/aux/swarm_metrics.jsonl", metadata={
        "help": "JSONL file that gets one row of swarm statistics per epoch; the plot (.png) is redrawn next to it."})
    history_window: int = field(default=10_000, metadata={
        "help": "Epochs kept in memory for the plot (the JSONL file keeps all of them)."})
    wandb_project: str = field(default="lean_transformer", metadata={
        "help": "Weights & Biases project ('' to disable). Online with an API key (WANDB_API_KEY or `wandb login`), "
                "else offline (upload later with `wandb sync`)."})
    wandb_dir: Optional[str] = field(default=None, metadata={
        "help": "Directory for wandb's files (default: WANDB_DIR or ./wandb)."})
    checkpoint_dir: str = field(default="outputs/aux/checkpoints", metadata={
        "help": "Where the swarm's checkpoints are written (epoch-NNNNNN/ subdirectories)."})
    checkpoint_every_epochs: int = field(default=10, metadata={
        "help": "Download the swarm's state and write a checkpoint every this many epochs (0: never)."})
    keep_checkpoints: int = field(default=3, metadata={"help": "How many of the newest checkpoints to keep."})
    hub_repo_id: Optional[str] = field(default=None, metadata={
        "help": "Hugging Face Hub model repo (owner/name) to mirror the newest checkpoint to (needs HF_TOKEN or "
                "`huggingface-cli login`). A failed upload is logged and retried with a later checkpoint."})
    hub_upload_interval: float = field(default=3600.0, metadata={
        "help": "Minimum seconds between two Hub uploads."})
    hub_public: bool = field(default=False, metadata={
        "help": "Create the Hub repo public (default: private; an existing repo keeps its visibility)."})
    upload_training_state: bool = field(default=False, metadata={
        "help": "Also upload the optimizer state, LR schedule and epoch (training_state.pt), so that --resume_from "
                "the Hub repo works; by default only the model, its config and the tokenizer are uploaded."})
    eval_batches: int = field(default=4, metadata={
        "help": "Held-out batches (--per_device_batch_size x --max_sequence_length, see --validation_fraction) "
                "each checkpoint is evaluated on; the validation loss is logged beside the training loss. 0: no "
                "evaluation. Runs on the aux peer's CPU, one forward pass per batch."})
    assist_in_averaging: bool = field(default=False, metadata={
        "help": "Take part in all-reduce without gradients of its own (hivemind's auxiliary mode), so that "
                "client-mode trainers have a full peer to average through. Needs incoming connections."})
    assist_refresh_period: float = field(default=0.5, metadata={
        "help": "Seconds between checks for an averaging round to join, with --assist_in_averaging."})
    dashboard_port: Optional[int] = field(default=None, metadata={
        "help": "Serve a live, read-only page of the run (loss, validation loss, samples/s, peers, contributors) on "
                "this TCP port (0: any free port; the URL is logged). Off by default."})
    dashboard_host: str = field(default="127.0.0.1", metadata={
        "help": "The address the live page listens on, with --dashboard_port (0.0.0.0: every interface, for a page "
                "others can open; it shows no secrets)."})

    def __post_init__(self):
        require(self.dashboard_port is None or 0 <= self.dashboard_port <= 65535, "dashboard_port",
                f"must be a TCP port (0-65535), got {self.dashboard_port}")
        require(bool(self.dashboard_host.strip()), "dashboard_host", "must be an address to listen on")
        for name in ("refresh_period", "assist_refresh_period", "history_window", "keep_checkpoints"):
            require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        for name in ("checkpoint_every_epochs", "hub_upload_interval", "eval_batches"):
            require(getattr(self, name) >= 0, name, f"must be non-negative, got {getattr(self, name)}")
        require(self.hub_repo_id is None or looks_like_repo_id(self.hub_repo_id), "hub_repo_id",
                f"{self.hub_repo_id!r} is not a Hub repo id (owner/name)")



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


