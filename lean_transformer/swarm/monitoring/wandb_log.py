"""Weights & Biases logging that works everywhere: online with an API key, offline (synced later) without one."""
from __future__ import annotations

import logging
import netrc
import os
from typing import Any, Mapping, Optional, Union

from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.evaluation import Evaluation

logger = logging.getLogger(__name__)


def has_wandb_credentials() -> bool:
    """True if an API key is set in the environment or saved by ``wandb login`` (in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger:
    """One wandb run for the aux peer: a row per global epoch (training loss, samples/s, peers) and a row per
    evaluated checkpoint (``validation_loss``), all charted against ``epoch`` (a checkpoint's epoch may be older than
    the last logged row, so wandb's own step, which only grows, counts rows instead).

    The mode is ``WANDB_MODE`` if set (e.g. ``disabled``), else online when credentials exist, else offline
    (``wandb sync`` uploads an offline run later). If an online start fails (no internet), it falls back to offline
    rather than stopping the peer.
    """

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any], directory: Optional[str] = None):
        import wandb  # slow to import; only peers that log pay for it

        mode = os.environ.get("WANDB_MODE") or ("online" if has_wandb_credentials() else "offline")
        init_kwargs = dict(project=project, name=run_name, config=dict(config), dir=directory)
        try:
            self.run = wandb.init(mode=mode, **init_kwargs)
        except Exception as error:  # wandb raises several error types for network / auth problems
            if mode != "online":
                raise
            logger.warning(f"wandb could not start online ({error}); logging offline instead")
            self.run = wandb.init(mode="offline", **init_kwargs)
        self.run.define_metric("epoch")
        self.run.define_metric("*", step_metric="epoch")
        logger.info(f"wandb run in {self.run.dir} (mode: {self.run.settings.mode})")

    def log(self, row: Union[SwarmStats, Evaluation]) -> None:
        self.run.log({key: value for key, value in row.to_dict().items() if value is not None and key != "time"})

    def finish(self) -> None:
        self.run.finish()
