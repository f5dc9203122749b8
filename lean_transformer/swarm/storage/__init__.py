"""Where the swarm's state is kept: checkpoint folders (:mod:`.checkpoint_dir`), the training state inside them
(:mod:`.training_state`) and the Hugging Face Hub mirror (:mod:`.hub`)."""
