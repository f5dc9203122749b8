"""A trainer that lies (issue 24; BTARD's attacks): ``run_trainer.py`` itself, except that right before each
optimizer step, i.e. before hivemind accumulates and averages them, its honest gradients are replaced:

- ``--attack sign_flip``: multiplied by ``-scale``;
- ``--attack random_direction``: a fixed random direction (one per tensor, seeded) at ``scale`` times the tensor's
  gradient norm.

Both are finite, so no non-finite guard catches them. Everything else (data, loss reports, weight = its samples) is
an honest trainer's.

With ``--start_file`` it imports everything, then waits (at most ``--start_timeout`` s) for that file before it
joins, so that a test can have it join at a chosen moment without the imports' delay.

Usage: python tests/lying_peer.py [--attack sign_flip|random_direction] [--scale 1000] [--start_file F]
       [run_trainer.py arguments]
"""
import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer  # noqa: E402


def lie(attack: str, scale: float) -> None:
    """Make every SwarmOptimizer of this process send ``attack``ed gradients."""
    honest_step = SwarmOptimizer.step
    directions = {}

    @torch.no_grad()
    def lying_step(self, *args, **kwargs):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if attack == "sign_flip":
                    param.grad.mul_(-scale)
                else:
                    if id(param) not in directions:
                        generator = torch.Generator().manual_seed(len(directions))
                        direction = torch.randn(param.grad.shape, generator=generator)
                        directions[id(param)] = direction / direction.norm()
                    param.grad.copy_(scale * param.grad.norm() * directions[id(param)])
        return honest_step(self, *args, **kwargs)

    SwarmOptimizer.step = lying_step


if __name__ == "__main__":
    own = argparse.ArgumentParser()
    own.add_argument("--attack", choices=("sign_flip", "random_direction"), default="sign_flip")
    own.add_argument("--scale", type=float, default=1000.0)
    own.add_argument("--start_file")
    own.add_argument("--start_timeout", type=float, default=300.0)
    options, rest = own.parse_known_args()
    lie(options.attack, options.scale)
    import run_trainer
    import transformers  # noqa: F401  (run_trainer's own imports, done before waiting)
    import lean_transformer.swarm.peers.trainer  # noqa: F401
    if options.start_file is not None:
        deadline = time.monotonic() + options.start_timeout
        while not Path(options.start_file).exists():
            if time.monotonic() > deadline:
                sys.exit(f"lying_peer.py: error: {options.start_file} did not appear within {options.start_timeout} s")
            time.sleep(0.05)
    sys.argv = [str(REPO / "run_trainer.py"), *rest]
    run_trainer.cli()
