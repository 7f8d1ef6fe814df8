"""What every job needs from its host, below the agents and the loop: files (local or gs://), metric logs,
progress bars, checkpoints, the backend choice and seed derivation."""
