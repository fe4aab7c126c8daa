"""Convolution corrections (CPU kernels)."""
