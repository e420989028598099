"""`axcore.trainer.memory_check`: XLA's memory analysis read in one place, its peak estimate."""

import jax
import jax.numpy as jnp
import numpy as np

from axcore.trainer.memory_check import MEMORY_FIELDS, estimated_peak, memory_analysis, memory_sizes


def test_memory_sizes_are_the_arrays_bytes_and_the_peak_their_sum_less_aliased():
    x = np.zeros((64, 32), np.float32)  # 8192 bytes in, 64 * 4 bytes out.
    compiled = jax.jit(lambda a: jnp.sum(a, axis=1)).lower(x).compile()
    sizes = memory_sizes(memory_analysis(compiled))
    assert sizes["argument"] == x.nbytes and sizes["output"] == 64 * 4
    assert list(sizes) == [f for f in MEMORY_FIELDS if f in sizes]
    expected = x.nbytes + 64 * 4 + sizes["temp"] - sizes.get("alias", 0)
    assert estimated_peak(sizes) == expected


def test_a_donated_argument_is_aliased_and_taken_off_the_peak():
    x = np.zeros((128,), np.float32)
    compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
    sizes = memory_sizes(memory_analysis(compiled))
    assert sizes["alias"] == x.nbytes
    assert estimated_peak(sizes) == sizes["argument"] + sizes["output"] + sizes["temp"] - x.nbytes


def test_a_backend_without_memory_analysis_gives_nothing():
    class Raises:
        def memory_analysis(self):
            raise NotImplementedError

    class Empty:
        def memory_analysis(self):
            return None

    assert memory_analysis(Raises()) == {} == memory_analysis(Empty())
    assert memory_sizes({}) == {} and estimated_peak({}) == 0
