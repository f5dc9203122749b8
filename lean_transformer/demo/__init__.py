"""Demonstrations that need no GPU and no internet: the whole swarm on this machine
(``python -m lean_transformer.demo``, :mod:`~lean_transformer.demo.local_swarm`), one process training a tiny
LeanGPT (:mod:`~lean_transformer.demo.one_process`), and the corpus both train on, whose entropy floor is known
exactly (:mod:`~lean_transformer.data.markov`)."""
