"""NumPy formulas shared by tests (imported as `numpy_ref`; tests/ is on sys.path)."""

import math

import numpy as np

from axcore.layers import Activation

_erf = np.vectorize(math.erf)

# The activations of `axcore.layers.Activation`, written from their definitions.
NP_ACTIVATIONS = {
    Activation.RELU: lambda x: np.maximum(x, 0.0),
    Activation.GELU: lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    Activation.GELU_TANH: lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    Activation.SILU: lambda x: x / (1.0 + np.exp(-x)),
}
