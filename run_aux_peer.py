#!/usr/bin/env python
"""The swarm's auxiliary peer: metrics (wandb, JSONL, PNG plot), checkpoints (model + tokenizer + training state),
their validation loss on held-out data, Hub upload (private, without the training state, by default), averaging
help, resuming.

Stable entry point:  python run_aux_peer.py --run_id my_run --identity_path aux.key --host_maddrs /ip4/0.0.0.0/tcp/31337
  (prints the --initial_peers line for trainers; the same key and port give the same address after a restart)
Seed a swarm:        python run_aux_peer.py --run_id my_run --resume_from outputs/aux/checkpoints
Pass it the trainers' model and optimizer flags (task, config, learning rate, ...): they shape its checkpoints.
Stop with Ctrl+C or SIGTERM.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

# installed, this file is lean_transformer_app/run_aux_peer.py, with arguments.py and tasks/ beside it
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arguments import (AuxSettings, AuxTrainingArguments, CollaborationSettings, NetworkSettings,  # noqa: E402
                       TaskArguments, parse_arguments)

logger = logging.getLogger("run_aux_peer")


def main(argv: Optional[Sequence[str]] = None) -> int:
    network, collaboration, task_args, training, aux = parse_arguments(  # flags first: cheap, no torch or hivemind yet
        [NetworkSettings, CollaborationSettings, TaskArguments, AuxTrainingArguments, AuxSettings], argv,
        description=__doc__)
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")

    from lean_transformer.swarm.peers.aux_peer import run_aux_peer
    from lean_transformer.swarm.peers.shutdown import errors_wait_for_an_ending
    from lean_transformer.swarm.protocol.dht import SwarmConnectionError
    from tasks import get_task

    run_config = {name: value for args in (network, collaboration, task_args, training, aux)
                  for name, value in dataclasses.asdict(args).items()}
    try:
        with errors_wait_for_an_ending():
            task = get_task(task_args.task)(task_args, training)
            run_aux_peer(task, network, collaboration, training, aux, task.swarm_settings(collaboration), run_config)
    except (ValueError, OSError, SwarmConnectionError) as e:
        logger.debug("Traceback of the error below (shown with HIVEMIND_LOGLEVEL=DEBUG)", exc_info=True)
        print(f"run_aux_peer.py: error: {e}", file=sys.stderr)
        return 1
    return 0


def cli() -> NoReturn:
    """The command: :func:`main`, then an exit that hivemind's daemon threads cannot abort."""
    from lean_transformer.swarm.peers.shutdown import exit_after_clean_shutdown
    exit_after_clean_shutdown(main())


if __name__ == "__main__":
    cli()
