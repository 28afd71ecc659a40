"""The daemon: its life, the scan and the per-set decision, jobs, steps, the
loop, the watcher, metrics."""
