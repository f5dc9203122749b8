"""The peer roles: the trainer (:mod:`.trainer`) and the auxiliary peer (:mod:`.aux_peer`), with what they share:
joining and leaving the swarm (:mod:`.swarm_peer`), progress lines (:mod:`.progress`), a bounded graceful shutdown
(:mod:`.shutdown`) and a trainer's local backups (:mod:`.backups`)."""
