"""The averaging engine: the swarm optimizer (:mod:`.optimizer`) with its averagers (:mod:`.averagers`, their rounds
reported by :mod:`.round_events`) and host gradients (:mod:`.host_grad_averager`), DiLoCo's outer loop
(:mod:`.diloco`) and its sparse top-k all-reduce (:mod:`.sparse_allreduce`), and per-block gradient scaling across the
swarm (:mod:`.block_scaling`)."""
