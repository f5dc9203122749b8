"""Everything a peer needs to take part in a swarm, by concern:

- :mod:`.protocol`: the DHT, signed metrics, the settings and their swarm-wide agreement;
- :mod:`.averaging`: the swarm optimizer, gradient averaging, DiLoCo's outer loop and its all-reduces;
- :mod:`.peers`: the trainer and the auxiliary peer, and what they share;
- :mod:`.storage`: checkpoints, the training state in them, the Hub mirror;
- :mod:`.monitoring`: peer events, swarm statistics, plots, wandb, evaluation;
- :mod:`.auth`: authorized swarms; :mod:`.hivemind_fixes`: our fixes of hivemind's bugs, each with its test.

Importing this package loads nothing else (the peers' flags parse without hivemind); :mod:`.protocol.dht`, which
every peer starts with, installs the global hivemind fixes.
"""
