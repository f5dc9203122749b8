"""Everything a peer needs to take part in a swarm: the DHT, signed metrics, the hivemind optimizer, checkpoints
and the trainer's loop. The auxiliary peer reuses the DHT, metrics and checkpoint modules."""

from lean_transformer.swarm import compat  # noqa: F401  (repairs hivemind's 8-bit decompression under NumPy >= 2.4)
