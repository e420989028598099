"""`axcore_lora.serving.stack_pairs`: adapters of different ranks and sites stacked by slot for the engine (NumPy).

The layout is a scanned model's (a leading axis of 3 layers before each pair's own dims), which the
engine's tests (one unscanned tiny model) do not reach; the products each slot adds are checked against
each adapter's own `scale * A @ B`, layer by layer.
"""

import types

import numpy as np

from axcore_lora.serving import stack_pairs

LAYERS, IN, HEADS, HEAD_DIM = 3, 8, 2, 4


def _pair(rng, rank):
    return {"lora_a": rng.normal(size=(LAYERS, IN, rank)).astype(np.float32),
            "lora_b": rng.normal(size=(LAYERS, rank, HEADS, HEAD_DIM)).astype(np.float32)}


def test_slots_hold_each_adapters_product_padded_with_zeros():
    rng = np.random.default_rng(0)
    first = {"layers": {"kernel_state": {"q_proj": _pair(rng, 4)}}}
    second = {"layers": {"kernel_state": {"q_proj": _pair(rng, 2), "v_proj": _pair(rng, 2)}}}
    settings = [types.SimpleNamespace(alpha=8.0), types.SimpleNamespace(alpha=3.0)]
    stacked = stack_pairs([first, second], settings)["layers"]["kernel_state"]
    q, v = stacked["q_proj"], stacked["v_proj"]
    assert q["lora_a"].shape == (LAYERS, 3, IN, 4) and q["lora_b"].shape == (LAYERS, 3, 4, HEADS, HEAD_DIM)
    assert v["lora_a"].shape == (LAYERS, 3, IN, 2) and q["lora_scale"].shape == (LAYERS, 3)
    np.testing.assert_array_equal(q["lora_scale"], np.tile([0.0, 8.0 / 4, 3.0 / 2], (LAYERS, 1)))
    np.testing.assert_array_equal(v["lora_scale"], np.tile([0.0, 0.0, 3.0 / 2], (LAYERS, 1)))
    for site, pairs in (("q_proj", [first["layers"]["kernel_state"]["q_proj"], second["layers"]["kernel_state"]["q_proj"]]),
                        ("v_proj", [None, second["layers"]["kernel_state"]["v_proj"]])):
        st = stacked[site]
        for layer in range(LAYERS):
            for slot, pair in enumerate([None, *pairs]):
                got = st["lora_a"][layer, slot] @ st["lora_b"][layer, slot].reshape(st["lora_a"].shape[-1], -1)
                got = got * st["lora_scale"][layer, slot]
                if pair is None:
                    want = np.zeros((IN, HEADS * HEAD_DIM), np.float32)
                else:
                    rank = pair["lora_a"].shape[-1]
                    scale = settings[slot - 1].alpha / rank
                    want = pair["lora_a"][layer] @ pair["lora_b"][layer].reshape(rank, -1) * np.float32(scale)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{site} {layer} {slot}")
    assert not q["lora_a"][:, 2, :, 2:].any() and not q["lora_b"][:, 2, 2:].any()  # Rank 2 padded to 4 with zeros.
