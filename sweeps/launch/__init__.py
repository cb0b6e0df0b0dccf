"""Launching a [program]'s script: its process group, its output, torchrun, and the tracer put into its processes."""
