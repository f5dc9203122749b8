"""The averaging engine: the swarm optimizer (:mod:`.optimizer`) with its gradient averaging and host gradients
(:mod:`.host_grad_averager`), DiLoCo's outer loop (:mod:`.diloco`) and its sparse top-k all-reduce
(:mod:`.sparse_allreduce`), and per-block gradient scaling across the swarm (:mod:`.block_scaling`)."""
