"""NumPy formulas that tests compare axcore's layers with, written from their definitions."""

from __future__ import annotations

import math

import numpy as np

from axcore.layers import Activation

_erf = np.vectorize(math.erf)

# The activations of `axcore.layers.Activation` (elementwise, any shape, float64 NumPy arrays in and out).
NP_ACTIVATIONS = {
    Activation.RELU: lambda x: np.maximum(x, 0.0),
    Activation.GELU: lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    Activation.GELU_TANH: lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    Activation.SILU: lambda x: x / (1.0 + np.exp(-x)),
}
