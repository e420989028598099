"""Weighted mixtures: several named sources, mixed by rows, deterministically and resumably.

`input.mixture` lists components `{name, weight, source}`. Each component is packed on
its own (so every row holds documents of one component) and the TRAIN rows are mixed
by Grain's `IterDataset.mix` over a mapping keyed by name: row k of the mixed stream
comes from the component a deterministic function of (k, the weights) names, so the
share of rows of each component is its weight (normalized) to within a row or so over
any window, with no randomness to seed. Because rows are nearly full (packing
efficiency is logged), the share of tokens follows the same weights.

Resume: the mixer's state holds each component's state under its name and the row
index k. Restoring with other weights continues every component where it stopped (no
row is replayed or skipped) and picks components by the new weights from row k on; a
component added on resume starts at its beginning, one removed is dropped. EVAL does
not mix: it reads each component's eval split in full, one after the other
(`axcore.data.iterator.ChainDataset`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import grain

from axcore.config import REQUIRED, ConfigBase, InstantiableConfig, Positive
from axcore.data.errors import DataError
from axcore.data.iterator import ChainDataset


class MixtureComponent(ConfigBase):
    """One component of `input.mixture`."""

    # Name: keys the component's saved state and its metric data/tokens/<name> (letters, digits, _ - .).
    name: str = REQUIRED
    # Relative weight: the component's share of rows is weight / (sum of the weights).
    weight: Annotated[float, Positive] = 1.0
    # The component's data source (a registered one, type: prepared, jsonl_files, ...).
    source: InstantiableConfig = REQUIRED


def check_components(components: Sequence[MixtureComponent]) -> None:
    """DataError naming `input.mixture[i]` for an empty mixture, a missing field or a repeated name."""
    if not components:
        raise DataError("input.mixture is empty; list components {name, weight, source} or remove it to use input.source.")
    seen: dict[str, int] = {}
    for i, component in enumerate(components):
        missing = component.missing_required()
        if missing:
            raise DataError(f"input.mixture[{i}] has no {', '.join(missing)}; every component needs a name and a source.")
        name = component.name
        if not name or not all(c.isalnum() or c in "_-." for c in name):
            raise DataError(f"input.mixture[{i}].name {name!r} must be non-empty letters, digits, '_', '-' or '.'.")
        if name in seen:
            raise DataError(f"input.mixture[{i}].name '{name}' repeats input.mixture[{seen[name]}]; names must differ.")
        seen[name] = i


def mix_rows(rows: Mapping[str, grain.IterDataset], weights: Mapping[str, float], train: bool) -> grain.IterDataset:
    """The components' packed rows mixed by `weights` (TRAIN) or chained in order (EVAL); module docstring."""
    if not train:
        return ChainDataset(list(rows.values()))
    return grain.IterDataset.mix(dict(rows), dict(weights))
