"""The commands a person runs: the CLI, status, tail, progress, loss, install-service."""
