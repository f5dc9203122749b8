"""Everything a peer needs to take part in a swarm: the DHT, signed metrics, the hivemind optimizer, checkpoints
and the trainer's loop. The auxiliary peer reuses the DHT, metrics and checkpoint modules. Security lives in
:mod:`~lean_transformer.swarm.auth`, our fixes of hivemind's bugs in :mod:`~lean_transformer.swarm.hivemind_fixes`
(installed on import)."""

from lean_transformer.swarm import hivemind_fixes  # noqa: F401
