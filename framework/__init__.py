"""Declarative DP x TP training on PyTorch's DeviceMesh, driven by Hydra configs."""
