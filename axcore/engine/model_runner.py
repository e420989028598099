"""The engine's model call: one compiled program per padded step shape, over a paged KV cache it holds.

`ModelRunner(model, num_blocks=..., block_size=..., batch_buckets=..., token_buckets=...,
max_programs=...)` owns the paged KV cache (`CausalLM.init_paged_cache`) and runs one
engine step as one call of `CausalLM.extend_paged`: the caller (the scheduler) gives the
step's rows (`tokens [b, t]`, `positions [b, t]`, `num_new [b]`, `block_tables [b, w]`,
the SHARED INTERFACE of `axcore.engine`), the runner pads them to the smallest bucket
`(B, T)` that holds them (empty rows: num_new 0, block table 0; padding tokens: id 0 at
position 0) and the tables to a width `W` (a power of two, or the longest table a
sequence can have), and runs the program of `(B, T, W)` on the caller's parameters
(passed through, never copied). Each row may name an adapter slot (`adapters [b]`, 0 =
the base; padding rows 0), which the model call sees through
`axcore.kernels.adapter_rows` (kernels holding stacked per-request adapters gather by it). The cache is donated to each call and replaced by the
one it returns, so it is updated in place on devices that support donation.

A ragged step (`logit_rows` given) feeds one token per row, several consecutive rows
holding one sequence's chunk, and asks logits of only the rows `logit_rows` names: its
rows are padded to `ragged_buckets` (token counts) and `logit_rows` to S, the padded rows
up to the largest batch bucket (`logit_rows_bucket`: one program per row bucket and table
width), so a step's prefill chunks and decodes run as one call with no padding to the
longest chunk.

Compilation is bounded: programs are compiled ahead of time, one per distinct
`(B, T, W, all_logits, S)` (S None: every row's logits), counted (`num_programs`,
`programs`), and a step that would compile one past `max_programs` raises
`ModelRunnerError` naming `max_programs`.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axcore.errors import AxcoreError
from axcore.kernels.adapter_rows import adapter_rows
from axcore.kernels.paged_attention import PAGED_ATTENTION
from axcore.kernels.registry import forward_only_programs, preferred_kernels, record_kernel_choices
from axcore.module import Module, functional


class ModelRunnerError(AxcoreError, ValueError):
    """A runner setting or a step's arrays are invalid; `field` names the setting or array."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"'{field}': {problem}")
        self.field, self.problem = field, problem


def _buckets(field: str, values: Sequence[int]) -> tuple[int, ...]:
    """`values` sorted, checked to be a non-empty list of distinct positive ints."""
    if isinstance(values, (int, str)) or not values:
        raise ModelRunnerError(field, f"is {values!r}; give a non-empty list of positive sizes, e.g. [1, 8, 32].")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ModelRunnerError(field, f"holds {v!r}; every bucket must be a positive integer.")
    if len(set(values)) != len(values):
        raise ModelRunnerError(field, f"is {list(values)!r}, which repeats a size; list each bucket once.")
    return tuple(sorted(int(v) for v in values))


def _positive(field: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ModelRunnerError(field, f"is {value!r}; it must be an integer >= {least}.")
    return int(value)


class ModelRunner:
    """Holds a model's paged KV cache and runs engine steps on it (module docstring).

    Args:
        model: a causal LM with `init_paged_cache` / `extend_paged` (`axcore.layers.CausalLM`).
        num_blocks: KV blocks of the cache, the null block 0 included (>= 2).
        block_size: tokens per block.
        batch_buckets: row counts B a step is padded to (the largest is the most rows per step).
        token_buckets: tokens per row T a step is padded to (the largest is the longest chunk).
        ragged_buckets: row counts a ragged step (one token per row) is padded to; None = batch_buckets.
        max_programs: most compiled programs; one more raises `ModelRunnerError`.
        kernels: op name -> kernel name the programs try first (`axcore.kernels.preferred_kernels`), or None.
    """

    def __init__(
        self,
        model: Module,
        *,
        num_blocks: int,
        block_size: int,
        batch_buckets: Sequence[int],
        token_buckets: Sequence[int],
        max_programs: int,
        ragged_buckets: Sequence[int] | None = None,
        kernels: dict[str, str] | None = None,
    ):
        self.model = model
        self.num_blocks = _positive("num_blocks", num_blocks, least=2)
        self.block_size = _positive("block_size", block_size)
        self.batch_buckets = _buckets("batch_buckets", batch_buckets)
        self.token_buckets = _buckets("token_buckets", token_buckets)
        self.ragged_buckets = self.batch_buckets if ragged_buckets is None else _buckets("ragged_buckets",
                                                                                         ragged_buckets)
        self.max_programs = _positive("max_programs", max_programs)
        self.kernels = dict(kernels or {})
        limit = model.max_cache_len()
        # Longest block table a sequence can need: its positions fill at most every non-null block.
        self.max_blocks_per_seq = self.num_blocks - 1 if limit is None else min(
            self.num_blocks - 1, -(-limit // self.block_size)
        )
        widths = {1 << i for i in range(self.max_blocks_per_seq.bit_length()) if 1 << i < self.max_blocks_per_seq}
        # Block-table widths W a step is padded to: powers of two, then the longest table.
        self.table_buckets = tuple(sorted(widths | {self.max_blocks_per_seq}))
        # The same for ragged steps; `widen_ragged_tables` makes them few where a wide table costs nothing.
        self.ragged_table_buckets = self.table_buckets
        # The paged KV cache (`CausalLM.init_paged_cache`), replaced by each step's updated one.
        self.cache = model.init_paged_cache(self.num_blocks, self.block_size)
        self._jitted = jax.jit(self._step, donate_argnums=(1,), static_argnames=("all_logits",))
        self._programs: dict[tuple[int, int, int, bool, int | None], Any] = {}

    @property
    def num_programs(self) -> int:
        """Programs compiled so far."""
        return len(self._programs)

    @property
    def programs(self) -> list[tuple[int, int, int, bool, int | None]]:
        """The `(B, T, W, all_logits, S)` of each compiled program, in compile order (S: the logit rows of a
        ragged step's program, None for every row's)."""
        return list(self._programs)

    def temp_bytes(self) -> dict[tuple[int, int, int, bool, int | None], int]:
        """Scratch bytes each compiled program needs besides its inputs and outputs (XLA's memory analysis;
        the donated cache is updated in place, so this stays far below `cache_bytes`)."""
        return {key: int(program.memory_analysis().temp_size_in_bytes) for key, program in self._programs.items()}

    @property
    def cache_bytes(self) -> int:
        """Bytes of the paged KV cache (every layer's keys and values)."""
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self.cache))

    def padded_shape(self, rows: int, tokens: int, width: int, ragged: bool = False) -> tuple[int, int, int]:
        """`(B, T, W)`: the smallest batch (`ragged`: ragged-step), token and table-width buckets holding a
        step's sizes (a ragged step's rows hold one token each: T = 1, whatever the token buckets)."""
        field, buckets = ("ragged_buckets", self.ragged_buckets) if ragged else ("batch_buckets", self.batch_buckets)
        return (
            self._bucket(field, buckets, rows, "rows"),
            self._bucket("token_buckets", (1,) if ragged else self.token_buckets, tokens, "tokens per row"),
            self._bucket("block_tables", self.ragged_table_buckets if ragged else self.table_buckets, width,
                         "blocks per sequence"),
        )

    def widen_ragged_tables(self) -> tuple[int, ...]:
        """Pads ragged steps' block tables to few widths: 64 blocks, then 8x wider each time, then the longest
        table; returns them. For kernels that read blocks in place (`decode_reads_blocks_in_place`), where a
        wider table costs only its int32 entries: a program then serves every width up to its own, so a
        server compiles about one program per row bucket (each compile stalls every stream for seconds)."""
        widths = {64 * 8 ** i for i in range(8) if 64 * 8 ** i < self.max_blocks_per_seq}
        self.ragged_table_buckets = tuple(sorted(widths | {self.max_blocks_per_seq}))
        return self.ragged_table_buckets

    @staticmethod
    def _bucket(field: str, buckets: tuple[int, ...], size: int, what: str) -> int:
        i = bisect.bisect_left(buckets, size)
        if i == len(buckets):
            raise ModelRunnerError(field, f"a step has {size} {what}, more than the largest bucket {buckets[-1]}.")
        return buckets[i]

    def step(
        self,
        params: Any,
        tokens: np.ndarray,
        positions: np.ndarray,
        num_new: np.ndarray,
        block_tables: np.ndarray,
        *,
        adapters: np.ndarray | None = None,
        all_logits: bool = False,
        logit_rows: np.ndarray | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Runs one engine step; the cache keeps the new tokens' keys and values.

        Args:
            params: the model's parameter tree (the live one; it is read, never copied or donated).
            tokens: `[b, t]` int, row r = a chunk of one sequence, left-aligned.
            positions: `[b, t]` int absolute positions of those tokens.
            num_new: `[b]` int valid tokens per row (0: an empty row).
            block_tables: `[b, w]` int block ids of each row's sequence (padded with 0).
            adapters: `[b]` int adapter slot of each row (0 = the base; None = all 0), for kernels whose
                parameters stack per-request adapters (`axcore.kernels.adapter_rows`).
            all_logits: also return every token's logits (prompt log-probabilities).
            logit_rows: `[s]` int, a ragged step: the logits returned are those of these rows (each a
                sequence's last fed token), padded to S (`logit_rows_bucket`); rows to a ragged bucket.

        Returns:
            float32 logits `[B, vocab]` of each row's last valid token (rows >= b: padding
            rows, finite garbage; `[S, vocab]` of the `logit_rows`, then padding, in a ragged
            step); with `all_logits`, `(that, [B, T, vocab])`.
        """
        arrays = self._checked(tokens, positions, num_new, block_tables)
        b, t = arrays[0].shape
        ragged = logit_rows is not None
        shape = self.padded_shape(b, t, arrays[3].shape[1], ragged=ragged)
        rows, cols = shape[0], (shape[1], shape[1], None, shape[2])
        padded = [np.pad(a, [(0, rows - b)] + ([] if c is None else [(0, c - a.shape[1])])) for a, c in zip(arrays, cols)]
        padded.append(np.pad(self._slots(adapters, b), (0, rows - b)))
        selected = None
        if ragged:
            if all_logits:
                raise ModelRunnerError("logit_rows", "a ragged step returns the logit rows' logits only; "
                                       "drop all_logits or logit_rows.")
            picks = self._logit_rows(logit_rows, b)
            selected = self.logit_rows_bucket(rows)
            if len(picks) > selected:
                raise ModelRunnerError("logit_rows", f"names {len(picks)} rows, more than the largest batch bucket "
                                       f"{self.batch_buckets[-1]}; give at most that many.")
            padded.append(np.pad(picks, (0, selected - len(picks))))
        program = self._program(params, (*shape, bool(all_logits), selected), padded)
        out, self.cache = program(params, self.cache, *padded)
        return out

    def _program(self, params: Any, key: tuple[int, int, int, bool, int | None], padded: list[np.ndarray]) -> Any:
        """The compiled program of `key` (`programs`), compiled for these padded arrays if it is new."""
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= self.max_programs:
                raise ModelRunnerError(
                    "max_programs",
                    f"a step of shape (rows, tokens, table width) {key[:3]} needs compiled program "
                    f"{len(self._programs) + 1}, past max_programs {self.max_programs} (compiled: "
                    f"{self.programs}); raise max_programs or use fewer buckets.",
                )
            with preferred_kernels(self.kernels), forward_only_programs():  # Never differentiated.
                program = self._jitted.lower(params, self.cache, *padded, all_logits=key[3]).compile()
            self._programs[key] = program
        return program

    def precompile_ragged(self, params: Any, width: int = 1) -> list[tuple[int, int, int, bool, int | None]]:
        """Compiles, without running, the ragged step program of every ragged row bucket for tables of `width`
        blocks (padded to its bucket), as a server does before it takes requests; returns the keys compiled
        now. Each compile takes seconds, and a step that needs one stalls every stream until it is done."""
        compiled = []
        for rows in self.ragged_buckets:
            key = (*self.padded_shape(rows, 1, width, ragged=True), False, self.logit_rows_bucket(rows))
            if key in self._programs:
                continue
            zeros = [np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32),
                     np.zeros((rows, key[2]), np.int32), np.zeros(rows, np.int32), np.zeros(key[4], np.int32)]
            self._program(params, key, zeros)
            compiled.append(key)
        return compiled

    def logit_rows_bucket(self, rows: int) -> int:
        """S, the logit rows of a ragged step padded to `rows` rows: `rows` up to the largest batch bucket, else
        that bucket (a step never samples more sequences than either)."""
        return min(rows, self.batch_buckets[-1])

    def decode_reads_blocks_in_place(self, params: Any) -> bool:
        """Whether every `paged_attention` call of a decode step goes to a kernel that reads its blocks in
        place (declares `reads_blocks_in_place`; `axcore.kernels.paged_attention`), found by tracing one
        abstract decode step (nothing compiled or run)."""
        one = np.ones((1, 1), np.int32)
        arrays = (one, one * 0, one[0], one, one[0] * 0)  # tokens, positions, num_new, tables, adapters.
        with record_kernel_choices() as choices, preferred_kernels(self.kernels), forward_only_programs():
            jax.eval_shape(functools.partial(self._step, all_logits=False), params, self.cache, *arrays)
        chosen = choices.get(PAGED_ATTENTION.name, {})
        kernels = {k.name: k for k in self.model.registries.kernels.candidates(PAGED_ATTENTION)}
        return bool(chosen) and all(getattr(kernels.get(name), "reads_blocks_in_place", False) for name in chosen)

    @staticmethod
    def _logit_rows(logit_rows: np.ndarray, b: int) -> np.ndarray:
        """The `[s]` int32 logit rows, checked to index the step's b rows (`ModelRunnerError` naming `logit_rows`)."""
        picks = np.asarray(logit_rows)
        if picks.ndim != 1 or not np.issubdtype(picks.dtype, np.integer) or (
                picks.size and (picks.min() < 0 or picks.max() >= b)):
            raise ModelRunnerError("logit_rows", f"has shape {picks.shape} and dtype {picks.dtype}; expected 1-D "
                                   f"integers in 0..{b - 1} (rows of the step).")
        return picks.astype(np.int32)

    @staticmethod
    def _slots(adapters: np.ndarray | None, b: int) -> np.ndarray:
        """The `[b]` int32 adapter slot per row (zeros for None), checked (`ModelRunnerError` naming `adapters`)."""
        if adapters is None:
            return np.zeros(b, np.int32)
        slots = np.asarray(adapters)
        if slots.shape != (b,) or not np.issubdtype(slots.dtype, np.integer) or (b and slots.min() < 0):
            raise ModelRunnerError("adapters", f"has shape {slots.shape} and dtype {slots.dtype}; expected [{b}] "
                                   "non-negative integers (one adapter slot per row, 0 = the base).")
        return slots.astype(np.int32)

    def _checked(self, tokens, positions, num_new, block_tables) -> list[np.ndarray]:
        """The step's arrays as int32 NumPy, shapes and ranges checked (`ModelRunnerError` naming the array)."""
        arrays = [np.asarray(a) for a in (tokens, positions, num_new, block_tables)]
        names = ("tokens", "positions", "num_new", "block_tables")
        for name, a, ndim in zip(names, arrays, (2, 2, 1, 2)):
            if a.ndim != ndim or not np.issubdtype(a.dtype, np.integer):
                raise ModelRunnerError(name, f"has shape {a.shape} and dtype {a.dtype}; expected {ndim}-D integers.")
        tokens, positions, num_new, tables = arrays
        b, t = tokens.shape
        if positions.shape != (b, t) or num_new.shape != (b,) or tables.shape[0] != b:
            raise ModelRunnerError(
                "positions", f"shapes {positions.shape}, num_new {num_new.shape}, block_tables {tables.shape} do "
                f"not match tokens {tokens.shape} (want [b, t], [b], [b, w])."
            )
        if b and (num_new.min() < 0 or num_new.max() > t):
            raise ModelRunnerError("num_new", f"holds values outside 0..{t} (the tokens per row).")
        if tables.size and (tables.min() < 0 or tables.max() >= self.num_blocks):
            raise ModelRunnerError("block_tables", f"holds block ids outside 0..{self.num_blocks - 1}.")
        row, col = np.nonzero(np.arange(t)[None, :] < num_new[:, None])  # The valid tokens.
        index = positions[row, col] // self.block_size
        if row.size and (positions.min() < 0 or index.max() >= tables.shape[1] or not tables[row, index].all()):
            raise ModelRunnerError(
                "block_tables", "a valid token's position has no block (negative, past the table, or block 0); "
                "allocate the sequence's blocks before the step."
            )
        return [a.astype(np.int32) for a in arrays]

    def _step(self, params, cache, tokens, positions, num_new, block_tables, adapters, logit_rows=None, *,
              all_logits: bool):
        """The compiled step: `extend_paged` (each row's adapter slot in `adapter_rows`), then the last valid
        token's logits (of the `logit_rows` only, if given; every token's too, if asked)."""
        inputs = {
            "input_ids": tokens, "cache": cache, "positions": positions, "num_new": num_new,
            "block_tables": block_tables, "all_logits": all_logits,
        }
        if logit_rows is not None:
            inputs["logit_rows"] = logit_rows
        with adapter_rows(adapters):
            (logits, cache), _ = functional(self.model, params, inputs, None, False, method="extend_paged")
        if not all_logits:
            return logits, cache
        last = jnp.take_along_axis(logits, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
        return (last, logits), cache
