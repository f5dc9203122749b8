"""The task interface: everything that differs between training objectives (model class, default config, how text
becomes batches) behind one small class, plus what they share (tokenizer, data source, param groups, LAMB, LR
schedule, sequence-length warmup)."""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import PretrainedConfig, PreTrainedModel

from lean_transformer.swarm.protocol.settings import Batch, Batcher, agreed_settings
from tasks.data import make_text_source
from tasks.schedules import learning_rate_factor, sequence_length
from tasks.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import CollaborationSettings, TrainingSettings
    from tasks.settings import TaskArguments

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
VALIDATION_SEED = 0  # orders the held-out documents (and seeds MLM masking on them)
__all__ = ["Batch", "Batcher", "CONFIGS_DIR", "Task"]


class Task(ABC):
    """One training objective. Subclasses set the class attributes and turn documents into batches. Instances
    satisfy the library's :class:`~lean_transformer.swarm.protocol.settings.TrainingTask` protocol."""

    name: ClassVar[str]
    default_config: ClassVar[str]  # file name in tasks/configs/
    config_class: ClassVar[type[PretrainedConfig]]
    model_class: ClassVar[type[PreTrainedModel]]

    def __init__(self, task_args: TaskArguments, training_args: TrainingSettings):
        """Load the tokenizer and the config and open the data source: every bad path fails here, at start-up."""
        self.task_args, self.training_args = task_args, training_args
        self.tokenizer = load_tokenizer(task_args.tokenizer_path)
        self.config = self._load_config(task_args.model_config_path or os.path.join(CONFIGS_DIR, self.default_config))
        self.text_source = make_text_source(task_args)

    def _load_config(self, path: str) -> PretrainedConfig:
        try:
            with open(path) as file:
                options = json.load(file)
        except FileNotFoundError:
            raise FileNotFoundError(f"--model_config_path: {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--model_config_path: {path} is not valid JSON ({e})") from None
        # the embedding matrix follows the tokenizer (rounded up for faster matmuls); special ids follow it too
        options.update(vocab_size=-(-len(self.tokenizer) // 8) * 8, pad_token_id=self.tokenizer.pad_token_id,
                       eos_token_id=self.tokenizer.eos_token_id, bos_token_id=self.tokenizer.eos_token_id)
        options.pop("model_type", None)
        try:
            return self.config_class(**options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--model_config_path: {path}: {e}") from None

    def build_model(self) -> PreTrainedModel:
        """A freshly initialized model; the same on every peer (seeded with --seed)."""
        torch.manual_seed(self.training_args.seed)
        return self.model_class(self.config)

    @abstractmethod
    def batcher(self, documents: Iterator[str], seed: int) -> Batcher:
        """Turn a stream of documents into batches (``seed`` drives masking and other randomness)."""

    def batches(self, seed: int) -> Batcher:
        """This peer's batches of training documents; ``seed`` (derived from the peer's identity) orders its data."""
        return self.batcher(self.text_source.documents(seed, split="train"), seed)

    def validation_batches(self, count: int) -> list[Batch]:
        """``count`` batches of held-out documents (--per_device_batch_size x --max_sequence_length), the same on
        every call and every machine: the aux peer evaluates each checkpoint on them."""
        batcher = self.batcher(self.text_source.documents(VALIDATION_SEED, split="validation"), VALIDATION_SEED)
        args = self.training_args
        return [batcher.next_batch(args.per_device_batch_size, args.max_sequence_length) for _ in range(count)]

    def save_tokenizer(self, directory: str) -> None:
        """Write the tokenizer into a checkpoint directory (Hugging Face's format)."""
        self.tokenizer.save_pretrained(directory)

    def swarm_settings(self, collaboration: CollaborationSettings) -> dict[str, Any]:
        """What every peer of a run must agree on (see lean_transformer.swarm.protocol.agreement), named by flag: the
        fields marked ``agree`` in the settings, with the model config spelled out and the tokenizer as its
        fingerprint."""
        settings = {f"model_config_path ({name})": value for name, value in sorted(self.config.to_diff_dict().items())
                    if name not in ("transformers_version",)}
        settings.update(task=self.name, tokenizer_path=self.tokenizer.fingerprint(),
                        **agreed_settings(self.task_args, self.training_args, collaboration))
        return settings

    def sequence_length(self, epoch: int) -> int:
        args = self.training_args
        return sequence_length(epoch, args.initial_sequence_length or args.max_sequence_length,
                               args.max_sequence_length, args.sequence_length_warmup_steps, args.pad_to_multiple_of)

    def param_groups(self, model: nn.Module) -> list[dict]:
        """Weight decay for matrices and embeddings, none for biases and LayerNorm weights (empty groups dropped)."""
        no_decay = {id(param) for module in model.modules() if isinstance(module, nn.LayerNorm)
                    for param in module.parameters(recurse=False)}
        no_decay |= {id(param) for name, param in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}
        params = [param for param in model.parameters() if param.requires_grad]
        decay = self.training_args.weight_decay
        groups = [dict(params=[p for p in params if id(p) not in no_decay], weight_decay=decay),
                  dict(params=[p for p in params if id(p) in no_decay], weight_decay=0.0)]
        return [group for group in groups if group["params"]]

    def optimizer_factory(self) -> Callable[[list[dict]], torch.optim.Optimizer]:
        """LAMB with 8-bit statistics on the CPU (what hivemind's offloaded optimizer runs on)."""
        from lean_transformer.optim import CPULAMB8Bit

        args = self.training_args
        return partial(CPULAMB8Bit, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                       eps=args.adam_epsilon, clamp_value=args.clamp_value, bias_correction=True,
                       max_grad_norm=args.max_grad_norm, min_8bit_size=args.min_8bit_size)

    def scheduler_factory(self) -> Callable[[torch.optim.Optimizer], LambdaLR]:
        """Warmup and decay over swarm epochs; hivemind steps it once per epoch."""
        args = self.training_args
        factor = partial(learning_rate_factor, warmup_steps=args.warmup_steps, total_steps=args.total_steps,
                         kind=args.lr_schedule)
        return partial(LambdaLR, lr_lambda=factor)
