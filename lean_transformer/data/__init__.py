"""Training data that ships with the library: an embedded corpus with a known entropy floor (:mod:`.markov`), so a
swarm trains offline and its loss can be checked against the floor."""
