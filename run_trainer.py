#!/usr/bin/env python
"""Join a hivemind swarm and train the lean transformer with it.

Start a new swarm:       python run_trainer.py --run_id my_run
Join an existing swarm:  python run_trainer.py --run_id my_run --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
(a full peer prints its own ready-to-paste --initial_peers line on start). Stop with Ctrl+C or SIGTERM.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

# installed, this file is lean_transformer_app/run_trainer.py, with arguments.py and tasks/ beside it
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arguments import CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings, parse_arguments  # noqa: E402

logger = logging.getLogger("run_trainer")


def main(argv: Optional[Sequence[str]] = None) -> int:
    network, collaboration, training, task_args = parse_arguments(  # flags first: cheap, no torch or hivemind yet
        [NetworkSettings, CollaborationSettings, TrainingSettings, TaskArguments], argv, description=__doc__)
    import transformers
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars between the progress lines
    from lean_transformer.swarm.peers.backups import NonFiniteParametersError
    from lean_transformer.swarm.protocol.dht import SwarmConnectionError
    from lean_transformer.swarm.peers.shutdown import errors_wait_for_an_ending, exit_now
    from lean_transformer.swarm.peers.trainer import train
    from tasks import get_task

    try:
        with errors_wait_for_an_ending():
            task = get_task(task_args.task)(task_args, training)
            train(task, network, collaboration, training, task.swarm_settings(collaboration))
    except (ValueError, OSError, SwarmConnectionError, NonFiniteParametersError) as e:
        logger.debug("Traceback of the error below (shown with HIVEMIND_LOGLEVEL=DEBUG)", exc_info=True)
        print(f"run_trainer.py: error: {e}", file=sys.stderr)
        return 1
    except Exception:  # a bug: show where, and make sure that no hivemind thread keeps the process alive
        logger.exception("Unexpected error, stopping")
        exit_now(1)
    return 0


def cli() -> NoReturn:
    """The command: :func:`main`, then an exit that hivemind's daemon threads cannot abort."""
    from lean_transformer.swarm.peers.shutdown import exit_after_clean_shutdown
    exit_after_clean_shutdown(main())


if __name__ == "__main__":
    cli()
