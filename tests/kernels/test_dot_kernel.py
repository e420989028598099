"""The dot op's kernels against NumPy (contractions, mixed precision), their selection, and the CPU kernel's HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.errors import KernelNotSupportedError
from axcore.kernels.dot import DOT, XlaCpuDot, XlaDot, dot_problem
from axcore.layers import Linear

KERNELS = [XlaDot(), XlaCpuDot()]


def linear(kernel, x, w, compute_dtype=None, platform="cpu"):
    """`kernel` as a plain 2-D-weight linear map (contract the weight's first dim)."""
    problem = dot_problem(x, w, (0,), compute_dtype=compute_dtype or x.dtype, platform=platform)
    return kernel(problem, x, w)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dims", [(3, 7), (7, 3), (5, 5)], ids=["up", "down", "square"])
def test_values_and_gradients_match_numpy(kernel, dims):
    d_in, d_out = dims
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    r = rng.standard_normal((2, 5, d_out)).astype(np.float32)  # d loss / d y.

    def loss(x, w):
        return jnp.sum(linear(kernel, x, w) * r)

    y = linear(kernel, jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, r @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x.reshape(-1, d_in).T @ r.reshape(-1, d_out), rtol=1e-5, atol=1e-5)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_cpu_kernel_keeps_bfloat16_and_works_under_vmap_and_scan():
    x = jnp.ones((4, 3, 2), jnp.bfloat16)
    w = jnp.full((2, 6), 0.5, jnp.bfloat16)
    kernel = XlaCpuDot()
    dw = jax.grad(lambda w: jnp.sum(linear(kernel, x, w).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.full((2, 6), 12.0))
    ws = jnp.stack([w, 2 * w])
    per_w = jax.vmap(jax.grad(lambda w: jnp.sum(linear(kernel, x, w).astype(jnp.float32))))(ws)
    np.testing.assert_allclose(np.asarray(per_w, np.float32), np.full((2, 2, 6), 12.0))

    def body(h, w):
        return linear(kernel, h, w), None

    square = jnp.stack([jnp.eye(2, dtype=jnp.float32)] * 3)
    out = jax.grad(lambda s: jnp.sum(jax.lax.scan(body, jnp.ones((3, 2)), s)[0]))(square)
    np.testing.assert_allclose(out, np.full((3, 2, 2), 3.0))


def test_the_cpu_kernel_is_opt_in_and_only_for_cpu_and_leading_contractions(registries):
    kernels = registries.kernels
    x, w = jax.ShapeDtypeStruct((2, 4), np.float32), jax.ShapeDtypeStruct((4, 16), np.float32)
    cpu = dot_problem(x, w, (0,), compute_dtype=np.float32, platform="cpu")
    gpu = dot_problem(x, w, (0,), compute_dtype=np.float32, platform="gpu")
    tied = dot_problem(x, jax.ShapeDtypeStruct((16, 4), np.float32), (1,), compute_dtype=np.float32, platform="cpu")
    assert kernels.select(DOT, cpu).name == "xla"  # Opt-in: below the reference.
    assert kernels.select(DOT, cpu, requested="xla_cpu").name == "xla_cpu"
    assert kernels.select(DOT, gpu).name == "xla"
    with pytest.raises(KernelNotSupportedError, match="other than the weight.s leading ones"):
        kernels.select(DOT, tied, requested="xla_cpu")
    with pytest.raises(KernelNotSupportedError, match="only for the cpu platform"):
        kernels.select(DOT, gpu, requested="xla_cpu")


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_multi_dim_contractions_match_numpy(kernel):
    """Attention's output projection: x [b, t, n, h] . wo [n, h, d] over (n, h)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    w = rng.standard_normal((3, 4, 6)).astype(np.float32)
    problem = dot_problem(x, w, (0, 1), compute_dtype=np.float32, platform="cpu")
    np.testing.assert_allclose(kernel(problem, x, w), np.einsum("btnh,nhd->btd", x, w), rtol=1e-5, atol=1e-5)


def test_reference_contracts_any_weight_dims_and_casts_for_mixed_precision():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    table = rng.standard_normal((11, 8)).astype(np.float32)  # A tied head: [vocab, dim], contract dim 1.
    problem = dot_problem(x, table, (1,), compute_dtype=jnp.bfloat16, output_dtype=np.float32, platform="cpu")
    logits = XlaDot()(problem, jnp.asarray(x), jnp.asarray(table))
    assert logits.dtype == np.float32
    # The operands are rounded to bfloat16, the products accumulated in float32.
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    t16 = np.asarray(jnp.asarray(table, jnp.bfloat16), np.float64)
    np.testing.assert_allclose(logits, x16 @ t16.T, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(logits), x.astype(np.float64) @ table.T.astype(np.float64), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda t: jnp.sum(XlaDot()(problem, jnp.asarray(x), t)))(jnp.asarray(table))
    assert grad.dtype == np.float32  # Gradients reach float32 master weights in float32.


def test_reference_declines_unknown_extras():
    x, w = jax.ShapeDtypeStruct((2, 4), np.float32), jax.ShapeDtypeStruct((4, 16), np.float32)
    support = XlaDot().is_supported(dot_problem(x, w, (0,), compute_dtype=np.float32, extras={"fp8": True}))
    assert not support and "fp8" in support.reason


def test_forward_mode_works_by_default_and_the_opt_in_cpu_kernel_refuses_it(registries):
    cfg = Linear.default_config().set(input_dim=3, output_dim=4, bias=False)
    x = jnp.ones((2, 3))
    for kernel in (None, "xla", "xla_cpu"):
        layer = cfg.clone(kernels=None if kernel is None else {"dot": kernel}).instantiate(name="proj", registries=registries)
        if kernel == "xla_cpu" and jax.default_backend() != "cpu":  # Only for the cpu platform.
            with pytest.raises(KernelNotSupportedError, match="only for the cpu platform"):
                layer.initialize(jax.random.key(0))
            continue
        params = layer.initialize(jax.random.key(0))

        def f(x, layer=layer, params=params):
            return axcore.functional(layer, params, (x,), None, False)[0]

        if kernel == "xla_cpu":  # Its custom VJP has no JVP rule.
            with pytest.raises(TypeError, match="custom_vjp"):
                jax.jvp(f, (x,), (x,))
        else:
            _, tangent = jax.jvp(f, (x,), (x,))
            np.testing.assert_allclose(tangent, np.asarray(x) @ np.asarray(params["weight"]), rtol=1e-6)


def test_weight_gradient_transposes_only_the_small_operand_on_cpu():
    """The point of `xla_cpu`: no [hidden, tokens] copy of an up-projection's gradient.

    (With the `xla` kernel, JAX 0.10.2's XLA:CPU makes three such copies here.)
    """
    kernel = XlaCpuDot()
    x = jnp.ones((8, 256, 64))
    w_up, w_down = jnp.ones((64, 512)), jnp.ones((512, 64))

    def loss(ws):
        hidden = jax.nn.gelu(linear(kernel, x, ws[0]), approximate=False)
        return jnp.sum(linear(kernel, hidden, ws[1]) ** 2)

    text = jax.jit(jax.grad(loss)).lower((w_up, w_down)).compile().as_text()
    big_transposed = len(re.findall(r"f32\[512,2048\]|f32\[512,8,256\]", text))
    assert big_transposed == 0


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_bfloat16_operands_with_a_float32_result_accumulate_and_return_float32(kernel):
    """An output head under mixed precision: bfloat16 operands, float32 logits (never rounded to bfloat16)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    problem = dot_problem(x, w, (0,), compute_dtype=jnp.bfloat16, output_dtype=np.float32, platform="cpu")
    y = kernel(problem, jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == np.float32
    x16, w16 = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, w))
    np.testing.assert_allclose(y, x16 @ w16, rtol=1e-5, atol=1e-5)  # A bfloat16 result would be off by ~1e-2.
    grad = jax.grad(lambda w: jnp.sum(kernel(problem, jnp.asarray(x), w) * 0.5))(jnp.asarray(w))
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad, 0.5 * x16.sum(0)[:, None] * np.ones((1, 40)), rtol=1e-2, atol=1e-2)


def _dot_operand_dtypes(fn, *args):
    """Operand dtypes of every dot_general in `fn`'s jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_float32_logits_from_bfloat16_operands_differentiate_in_bfloat16():
    """The backward matmuls of a wide result (an output head, attention scores) run in the operands' dtype."""
    from axcore.kernels import AttentionProblem, XlaAttention

    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 16), jnp.float32)
    problem = dot_problem(x, w, (0,), compute_dtype=jnp.bfloat16, output_dtype=np.float32, platform="gpu")
    dtypes = _dot_operand_dtypes(jax.grad(lambda x, w: jnp.sum(XlaDot()(problem, x, w)), argnums=(0, 1)), x, w)
    assert len(dtypes) >= 3 and set(dtypes) == {("bfloat16", "bfloat16")}, dtypes  # Forward, dx, dw.
    q = jnp.ones((1, 4, 4, 8), jnp.bfloat16)
    k = v = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    attention = AttentionProblem.of(q, k, causal=True)
    dtypes = _dot_operand_dtypes(jax.grad(lambda q, k, v: jnp.sum(XlaAttention()(attention, q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)), q, k, v)
    assert len(dtypes) >= 6 and set(dtypes) == {("bfloat16", "bfloat16")}, dtypes
