"""The linear op's kernels against NumPy, their selection, and the CPU kernel's HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import KernelNotSupportedError
from axcore.kernels.linear import LINEAR_OP, LinearProblem, XlaCpuLinear, XlaLinear
from axcore.layers import Linear

KERNELS = [XlaLinear(), XlaCpuLinear()]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dims", [(3, 7), (7, 3), (5, 5)], ids=["up", "down", "square"])
def test_values_and_gradients_match_numpy(kernel, dims):
    d_in, d_out = dims
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    r = rng.standard_normal((2, 5, d_out)).astype(np.float32)  # d loss / d y.

    def loss(x, w):
        return jnp.sum(kernel(x, w) * r)

    y = kernel(jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, r @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x.reshape(-1, d_in).T @ r.reshape(-1, d_out), rtol=1e-5, atol=1e-5)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_cpu_kernel_keeps_bfloat16_and_works_under_vmap_and_scan():
    x = jnp.ones((4, 3, 2), jnp.bfloat16)
    w = jnp.full((2, 6), 0.5, jnp.bfloat16)
    kernel = XlaCpuLinear()
    dw = jax.grad(lambda w: jnp.sum(kernel(x, w).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.full((2, 6), 12.0))
    ws = jnp.stack([w, 2 * w])
    per_w = jax.vmap(jax.grad(lambda w: jnp.sum(kernel(x, w).astype(jnp.float32))))(ws)
    np.testing.assert_allclose(np.asarray(per_w, np.float32), np.full((2, 2, 6), 12.0))

    def body(h, w):
        return kernel(h, w), None

    square = jnp.stack([jnp.eye(2, dtype=jnp.float32)] * 3)
    out = jax.grad(lambda s: jnp.sum(jax.lax.scan(body, jnp.ones((3, 2)), s)[0]))(square)
    np.testing.assert_allclose(out, np.full((3, 2, 2), 3.0))


def test_selection_prefers_the_cpu_kernel_only_on_cpu(registries):
    kernels = registries.kernels
    cpu = LinearProblem(4, 16, np.dtype(np.float32), "cpu")
    gpu = LinearProblem(4, 16, np.dtype(np.float32), "gpu")
    assert kernels.select(LINEAR_OP, cpu).name == "xla_cpu"
    assert kernels.select(LINEAR_OP, gpu).name == "xla"
    assert kernels.select(LINEAR_OP, cpu, requested="xla").name == "xla"
    with pytest.raises(KernelNotSupportedError, match="only for the cpu platform"):
        kernels.select(LINEAR_OP, gpu, requested="xla_cpu")


def test_linear_layer_kernel_field_forces_the_reference_kernel_for_forward_mode():
    cfg = Linear.default_config().set(input_dim=3, output_dim=4, bias=False)
    x = jnp.ones((2, 3))
    for kernel in (None, "xla"):
        layer = cfg.clone(kernel=kernel).instantiate(name="proj")
        params = layer.initialize(jax.random.key(0))

        def f(x, layer=layer, params=params):
            return axcore.functional(layer, params, (x,), None, False)[0]

        if kernel is None and jax.default_backend() == "cpu":  # The custom VJP has no JVP rule.
            with pytest.raises(TypeError, match="custom_vjp"):
                jax.jvp(f, (x,), (x,))
        else:
            _, tangent = jax.jvp(f, (x,), (x,))
            np.testing.assert_allclose(tangent, np.asarray(x) @ np.asarray(params["weight"]), rtol=1e-6)


def test_weight_gradient_transposes_only_the_small_operand_on_cpu():
    """The point of `xla_cpu`: no [hidden, tokens] copy of an up-projection's gradient.

    (With the `xla` kernel, JAX 0.10.2's XLA:CPU makes three such copies here.)
    """
    kernel = XlaCpuLinear()
    x = jnp.ones((8, 256, 64))
    w_up, w_down = jnp.ones((64, 512)), jnp.ones((512, 64))

    def loss(ws):
        hidden = jax.nn.gelu(kernel(x, ws[0]), approximate=False)
        return jnp.sum(kernel(hidden, ws[1]) ** 2)

    text = jax.jit(jax.grad(loss)).lower((w_up, w_down)).compile().as_text()
    big_transposed = len(re.findall(r"f32\[512,2048\]|f32\[512,8,256\]", text))
    assert big_transposed == 0
