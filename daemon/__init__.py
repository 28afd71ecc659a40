"""The daemon: watching, reconciling, jobs, steps, and the command line."""
