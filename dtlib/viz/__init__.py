"""Plotting functions: each takes data and returns a ``matplotlib.figure.Figure`` (no pyplot state)."""
