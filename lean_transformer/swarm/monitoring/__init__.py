"""What the aux peer makes of the trainers' metrics: per-epoch swarm statistics (:mod:`.aggregation`), their history
on disk (:mod:`.run_history`), the plot (:mod:`.plot`), wandb (:mod:`.wandb_log`) and checkpoint evaluation
(:mod:`.evaluation`); and what any peer reports: its event stream (:mod:`.events`) and the progress of a long transfer
(:mod:`.transfer`)."""
