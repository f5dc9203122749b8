"""The averaging engine: the swarm optimizer (:mod:`.optimizer`) with its averagers (:mod:`.averagers`, their rounds
reported by :mod:`.round_events`) and host gradients (:mod:`.host_grad_averager`), DiLoCo's outer loop
(:mod:`.diloco`) and its sparse top-k all-reduce (:mod:`.sparse_allreduce`), per-block gradient scaling across the
swarm (:mod:`.block_scaling`), and the defences against peers that lie: robust reducers (:mod:`.robust`), checks of
reducers' answers (:mod:`.answer_check`), exclusion (:mod:`.exclusion`) and the check of downloaded states
(:mod:`.state_check`)."""
