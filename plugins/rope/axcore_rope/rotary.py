"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864).

Pairing: rotate-half (the GPT-NeoX / Hugging Face Llama layout). Of a head's `dim`
features the leading `r = rotary_fraction * dim` are rotated and the rest pass
through unchanged (partial rotary, as in GPT-NeoX and Phi). Inside the rotated part,
feature `i` is paired with feature `i + r/2` (`i < r/2`), and pair `i` at position
`m` is rotated by the angle `m * f_i`:

    f_i           = theta ** (-2i / r)                      i = 0 .. r/2 - 1
    out_i         = x_i cos(m f_i) - x_{i+r/2} sin(m f_i)
    out_{i+r/2}   = x_{i+r/2} cos(m f_i) + x_i sin(m f_i)

so `q_m . k_n` depends only on `m - n`. (Weights trained with the interleaved
RoFormer pairing `(2i, 2i+1)` convert by permuting the head-dim columns of wq/wk.)

Frequency scaling for context extension (`scaling`; s = scaling_factor,
L = original_max_len), applied to `f_i` before the rotation:

- `llama3` (Meta's Llama 3.1 reference): with wavelength w_i = 2 pi / f_i,
  keep f_i if w_i < L / high_freq_factor; use f_i / s if w_i > L / low_freq_factor;
  otherwise, with g = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor),
  use (1 - g) f_i / s + g f_i.
- `yarn` (Peng et al. 2023, arXiv 2309.00071, as in the YaRN reference code and
  Hugging Face transformers): the pair index at which a wavelength fits n times
  into L is d(n) = r ln(L / (2 pi n)) / (2 ln theta); with
  lo = max(floor(d(beta_fast)), 0), hi = min(ceil(d(beta_slow)), r - 1)
  (hi += 0.001 if hi == lo) and ramp_i = clip((i - lo) / (hi - lo), 0, 1),
  use f_i (1 - ramp_i) + (f_i / s) ramp_i. Attention temperature: the rotated
  features of both q and k are multiplied by mscale = 0.1 ln(s) + 1 (1 if s <= 1),
  i.e. the paper's sqrt(1/t) on each of q and k, so their logits scale by
  mscale^2 = 1/t. Non-rotated features are not scaled.

Frequencies are computed in float64 from the config, angles and the rotation in
float32; q and k come back in their input dtype.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np

from axcore.config import ConfigBase, InstantiableConfig, Length, Positive, Range
from axcore.errors import ConfigError
from axcore.layers import PositionEmbedding


class Scaling(enum.Enum):
    # Plain RoPE frequencies.
    NONE = "none"
    # Llama 3.1 frequency-dependent interpolation.
    LLAMA3 = "llama3"
    # YaRN ("NTK-by-parts") interpolation plus attention temperature.
    YARN = "yarn"


class RotarySettings(ConfigBase):
    """The user-facing fields of RotaryEmbedding; also the plugin's `rope:` section."""

    # Base of the frequencies f_i = theta^(-2i/r) (10000 in RoFormer/Llama 2, 500000 in Llama 3).
    theta: Annotated[float, Range(gt=1)] = 10000.0
    # Fraction of head_dim that is rotated (the leading features); must give an even count.
    rotary_fraction: Annotated[float, Range(gt=0, le=1)] = 1.0
    # Frequency scaling for context extension: none, llama3 or yarn.
    scaling: Scaling = Scaling.NONE
    # llama3/yarn: ratio of the extended to the original context length.
    scaling_factor: Annotated[float, Positive] = 8.0
    # llama3/yarn: context length the model was originally trained with.
    original_max_len: Annotated[int, Length] = 8192
    # llama3: wavelengths above original_max_len / low_freq_factor are divided by scaling_factor.
    low_freq_factor: Annotated[float, Positive] = 1.0
    # llama3: wavelengths below original_max_len / high_freq_factor are kept.
    high_freq_factor: Annotated[float, Positive] = 4.0
    # yarn: pairs turning more than beta_fast times over original_max_len are kept.
    beta_fast: Annotated[float, Positive] = 32.0
    # yarn: pairs turning fewer than beta_slow times over original_max_len are divided by scaling_factor.
    beta_slow: Annotated[float, Positive] = 1.0


def _require(ok: bool, where: str, field: str, message: str, value) -> None:
    if not ok:
        raise ConfigError(
            f"Rotary setting '{where}.{field}' {message}, got {value!r}; change it in the experiment "
            f"file or with --set."
        )


def check_settings(cfg: RotarySettings, where: str) -> None:
    """Raises ConfigError naming `<where>.<field>` for an invalid rotary setting."""
    _require(cfg.theta > 0, where, "theta", "must be > 0", cfg.theta)
    _require(0 < cfg.rotary_fraction <= 1, where, "rotary_fraction", "must be in (0, 1]", cfg.rotary_fraction)
    if cfg.scaling is Scaling.NONE:
        return
    _require(cfg.scaling_factor > 0, where, "scaling_factor", "must be > 0", cfg.scaling_factor)
    _require(cfg.original_max_len > 0, where, "original_max_len", "must be > 0", cfg.original_max_len)
    if cfg.scaling is Scaling.LLAMA3:
        _require(cfg.low_freq_factor > 0, where, "low_freq_factor", "must be > 0", cfg.low_freq_factor)
        _require(
            cfg.high_freq_factor > cfg.low_freq_factor, where, "high_freq_factor",
            f"must be > low_freq_factor ({cfg.low_freq_factor})", cfg.high_freq_factor,
        )
    if cfg.scaling is Scaling.YARN:
        _require(cfg.beta_slow > 0, where, "beta_slow", "must be > 0", cfg.beta_slow)
        _require(
            cfg.beta_fast > cfg.beta_slow, where, "beta_fast", f"must be > beta_slow ({cfg.beta_slow})", cfg.beta_fast
        )


def rotary_dim(cfg: RotarySettings, head_dim: int, where: str) -> int:
    """r = rotary_fraction * head_dim, checked to be a positive even integer."""
    exact = cfg.rotary_fraction * head_dim
    r = round(exact)
    _require(
        abs(exact - r) < 1e-6 and r > 0 and r % 2 == 0, where, "rotary_fraction",
        f"times head_dim {head_dim} must be a positive even number of rotated dims (is {exact:g})",
        cfg.rotary_fraction,
    )
    return r


def rotary_config(settings: RotarySettings | None = None, where: str = "rope") -> InstantiableConfig:
    """A validated RotaryEmbedding config with the fields of `settings` (defaults if None)."""
    settings = settings if settings is not None else RotarySettings()
    check_settings(settings, where)
    fields = {name: getattr(settings, name) for name in RotarySettings().keys()}
    return RotaryEmbedding.default_config().set(**fields)


def rotary_frequencies(cfg: RotarySettings, r: int) -> np.ndarray:
    """Frequencies f_i `[r/2]` (float64) after `cfg.scaling`, per the module docstring."""
    freqs = cfg.theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    s, orig = cfg.scaling_factor, cfg.original_max_len
    if cfg.scaling is Scaling.LLAMA3:
        wavelen = 2 * np.pi / freqs
        smooth = (orig / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        mid = (1 - smooth) * freqs / s + smooth * freqs
        freqs = np.where(
            wavelen < orig / cfg.high_freq_factor, freqs, np.where(wavelen > orig / cfg.low_freq_factor, freqs / s, mid)
        )
    elif cfg.scaling is Scaling.YARN:

        def dim_of(rotations: float) -> float:
            return r * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

        lo = max(math.floor(dim_of(cfg.beta_fast)), 0)
        hi = min(math.ceil(dim_of(cfg.beta_slow)), r - 1)
        hi = hi + 0.001 if hi == lo else hi
        ramp = np.clip((np.arange(r // 2) - lo) / (hi - lo), 0.0, 1.0)
        freqs = freqs * (1 - ramp) + (freqs / s) * ramp
    return freqs


def yarn_mscale(cfg: RotarySettings) -> float:
    """Factor on the rotated features of q and of k: 0.1 ln(s) + 1 for yarn with s > 1, else 1."""
    if cfg.scaling is Scaling.YARN and cfg.scaling_factor > 1:
        return 0.1 * math.log(cfg.scaling_factor) + 1.0
    return 1.0


class RotaryEmbedding(PositionEmbedding):
    """Rotates the leading `rotary_fraction` of each q/k head by position (no parameters).

    Acts only in an attention slot (`transform_qk`); the slot sets `dim` = head_dim.
    """

    class Config(RotarySettings, PositionEmbedding.Config):
        """Configures RotaryEmbedding (the RotarySettings fields plus the slot's dim)."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        cfg = self._config
        check_settings(cfg, self.path)
        if cfg.dim is None:
            raise ConfigError(
                f"{self.path}: dim is unset; put the rotary embedding in an attention layer's "
                f"position_embedding slot, which sets dim to head_dim."
            )
        self._rotary_dim = rotary_dim(cfg, cfg.dim, self.path)

    def transform_qk(self, q, k, q_positions, k_positions):
        """q `[B, T, N, H]`, k `[B, S, K, H]`, positions `[B, T]` / `[B, S]` -> rotated `(q, k)`."""
        return self._rotate(q, q_positions), self._rotate(k, k_positions)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x `[B, T, heads, H]`, positions `[B, T]` -> x with its leading r features rotated."""
        r, half = self._rotary_dim, self._rotary_dim // 2
        freqs = jnp.asarray(rotary_frequencies(self._config, r), jnp.float32)
        angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, r/2]
        mscale = yarn_mscale(self._config)
        cos = (jnp.cos(angles) * mscale)[..., None, :]  # [B, T, 1, r/2]
        sin = (jnp.sin(angles) * mscale)[..., None, :]
        x1 = x[..., :half].astype(jnp.float32)
        x2 = x[..., half:r].astype(jnp.float32)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
        return jnp.concatenate([rotated, x[..., r:]], axis=-1)
