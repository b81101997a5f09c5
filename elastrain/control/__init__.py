"""Control plane: the coordinator (membership, quorum, store) and its client."""
