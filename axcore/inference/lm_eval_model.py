"""lm-evaluation-harness's model `axcore`: a run's checkpoint scored and sampled by lm-eval's tasks.

    from axcore.inference.lm_eval_model import register
    AxcoreLM = register()                       # lm-eval's LM class, registered as model "axcore"
    lm = AxcoreLM(run="runs/x", batch_size=8)   # or AxcoreLM(loaded=load_model("runs/x"))
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

lm-eval (`pip install 'axcore[lm-eval]'`) is imported lazily: this module imports without
it, and the class exists once `register()` (or the module attribute `AxcoreLM`) has
imported it; `axcore eval --tasks` does that. Registered, `lm_eval.simple_evaluate(model=
"axcore", model_args="run=runs/x")` builds it by name too.

Requests, as lm-eval's `hf` model serves them, so per-document results equal its:
- tokenization (`tok_encode`): the run's tokenizer with its own special tokens (e.g. a BOS
  where the run adds one), without them when lm-eval asks (`add_special_tokens=False`);
  context and continuation are encoded together and split, trailing spaces of the context
  moved to the continuation (lm-eval's `TemplateLM`); an empty context becomes
  `prefix_token_id` (the tokenizer's BOS, else its EOS).
- `loglikelihood`: `(sum of the continuation's token log-probabilities, whether each of its
  tokens is the argmax)`, from one forward pass over context + continuation (left-truncated
  to `max_length + 1` tokens, the last one not fed). Requests are sorted longest first (fewer
  pads), padded on the right to `batch_size` rows and a power-of-two length bucket (at least
  16 tokens), so the forward compiles once per bucket; it runs jitted under the run's
  placement (its mesh, parameter shardings and op environment).
- `loglikelihood_rolling` (perplexity tasks): the document's disjoint windows of
  `max_length` tokens (lm-eval's `get_rolling_token_windows`, one token of context), summed.
- `generate_until`: contexts left-truncated to `max_length - max_gen_toks`, continued by
  the inference engine (`axcore.engine.offline`: continuous batching of up to `batch_size`
  sequences over a paged KV cache, under the run's placement; greedy unless `do_sample`
  with a `temperature` > 0, then `top_k`/`top_p`, the draws seeded by `seed` and each
  request's rank; the tokenizer's EOS and the stop strings end a sequence early), decoded,
  and cut at the first stop string (`until`, plus the EOS text as lm-eval's `hf` model adds it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from axcore.errors import AxcoreError

# The name lm-eval knows the model by (`--model axcore`, `simple_evaluate(model="axcore")`).
MODEL_NAME = "axcore"
# Tokens generated when a task's generation_kwargs name no max_gen_toks (lm-eval's hf model's default).
DEFAULT_MAX_GEN_TOKS = 256
# Sequence length when the model has no position limit (lm-eval's hf model's default max_length).
DEFAULT_MAX_LENGTH = 2048
# The smallest padded length of a forward pass (buckets are powers of two from here).
MIN_BUCKET = 16
INSTALL_HINT = "pip install 'axcore[lm-eval]'"


class LmEvalError(AxcoreError):
    """lm-eval is missing, or the `axcore` model's arguments (or the run's tokenizer) do not fit a request."""


def import_lm_eval():
    """The `lm_eval` package; LmEvalError (naming the extra to install) when it is not installed."""
    try:
        import lm_eval
        import lm_eval.api.model
        import lm_eval.api.registry
    except ImportError as e:
        raise LmEvalError(f"lm-evaluation-harness is not installed ({e}); {INSTALL_HINT}.") from None
    return lm_eval


def bucket_length(length: int, limit: int) -> int:
    """The padded length of a batch whose longest row has `length` tokens: the next power of two
    (at least MIN_BUCKET), not past `limit` (nor below `length`)."""
    return max(length, min(limit, max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())))


@dataclasses.dataclass(frozen=True)
class Scored:
    """One scoring row: `tokens` fed `[n]`, the next token after each `[n]`, the last `cont_len` of which are scored."""

    # Input token ids (context + continuation, without its last token).
    tokens: list[int]
    # The token each input position predicts (the inputs shifted by one).
    targets: list[int]
    # How many trailing targets are the continuation's.
    cont_len: int


class AxcoreLMBase:
    """The `axcore` model's behaviour (module docstring); `register()` mixes it into lm-eval's `TemplateLM`.

    Args:
        run: a run directory (or its checkpoints/ or a step's directory), loaded with `load_model`.
        loaded: instead of `run`, an `axcore.inference.LoadedModel` (e.g. a live training's parameters).
        step: checkpoint step of `run` (default: the latest committed).
        overrides: `PATH=VALUE` config overrides for `run`, e.g. `mesh.mesh_shape=[-1]`.
        batch_size: rows per forward pass and per generation batch ("auto" = 8).
        max_length: tokens per sequence (default: the model's position limit, else 2048).
        seed: seed of sampled generations.
        prefix_token_id: the token an empty context becomes (default: the tokenizer's BOS, else EOS).
        kwargs: lm-eval's other model arguments (`device`, `max_batch_size`), unused: the run's
            placement decides the devices.
    """

    backend = "causal"

    def __init__(self, run: str | None = None, *, loaded: Any = None, step: int | None = None,
                 overrides: Sequence[str] = (), batch_size: int | str = 8, max_length: int | None = None,
                 seed: int = 1234, prefix_token_id: int | None = None, **kwargs: Any):
        super().__init__()
        from axcore.inference.run_loading import load_model_and_placement
        from axcore.placement.placement import Placement

        if (run is None) == (loaded is None):
            raise LmEvalError("The axcore lm-eval model needs exactly one of run=RUN_DIR and loaded=LoadedModel "
                              "(model_args 'run=runs/x').")
        if loaded is None:
            loaded, placement = load_model_and_placement(run, step=step, overrides=list(overrides))
        else:
            placement = Placement(loaded.experiment)
        self.loaded, self.placement = loaded, placement
        self.tokenizer = placement.tokenizer
        self.batch_size = _positive("batch_size", 8 if batch_size in ("auto", None) else batch_size)
        limit = loaded.model.max_cache_len()
        self.max_length = _positive("max_length", max_length or limit or DEFAULT_MAX_LENGTH)
        if limit is not None and self.max_length > limit:
            raise LmEvalError(f"max_length={self.max_length} is past the model's {limit} positions "
                              f"(its learned position embedding); pass max_length={limit} or less.")
        self.seed = int(seed)
        self.custom_prefix_token_id = prefix_token_id
        specials = self.tokenizer.encode("")  # The ids the tokenizer adds to every text (e.g. BOS).
        self._specials = len(specials)
        self._special_text = self.tokenizer.decode(specials) if self._specials else ""
        self._score = None  # The jitted scoring step, built on first use.

    # -- Tokens -----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (None when it has none)."""
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context becomes: `prefix_token_id` if given, else BOS, else EOS."""
        for token in (self.custom_prefix_token_id, self.tokenizer.bos_id, self.tokenizer.eos_id):
            if token is not None:
                return int(token)
        raise LmEvalError(f"The run's tokenizer ({type(self.tokenizer).__name__}) has no BOS or EOS token to stand "
                          f"for an empty context; pass model_args prefix_token_id=ID.")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """`string` -> ids, with the tokenizer's special tokens unless `add_special_tokens` is False
        (or the string already starts with them, as lm-eval's hf model checks for BOS)."""
        ids = [int(i) for i in self.tokenizer.encode(string)]
        if self._specials and (add_special_tokens is False or self._starts_with_specials(string)):
            ids = ids[self._specials:]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _starts_with_specials(self, string: str) -> bool:
        return bool(self._special_text) and string.startswith(self._special_text)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        """Token ids -> text."""
        return self.tokenizer.decode([int(t) for t in tokens])

    # -- Log-likelihoods --------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """`[(key, context_ids, continuation_ids)]` -> `[(sum log-prob of the continuation, is_greedy)]`."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise LmEvalError("A loglikelihood request has an empty continuation; lm-eval's tasks never "
                                  "send one: check the task's doc_to_choice/doc_to_target.")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append(Scored(whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        return self.score(rows)

    def score(self, rows: Sequence[Scored]) -> list[tuple[float, bool]]:
        """Each row's `(sum of its scored targets' log-probabilities, all of them argmax)`, in order.

        Rows run longest first, `batch_size` per forward pass, padded on the right (pads score nothing).
        """
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].tokens), rows[i].tokens))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = bucket_length(len(rows[chunk[0]].tokens), self.max_length)
            tokens = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), np.float32)
            for b, i in enumerate(chunk):
                row, n = rows[i], len(rows[i].tokens)
                tokens[b, :n], targets[b, :n] = row.tokens, row.targets
                mask[b, n - row.cont_len:n] = 1.0
            sums, greedy = self._score_batch(tokens, targets, mask)
            for b, i in enumerate(chunk):
                out[i] = (float(sums[b]), bool(greedy[b]))
        return out

    def _score_batch(self, tokens: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """tokens, targets int32 `[B, T]`, mask float32 `[B, T]` -> (masked log-prob sums `[B]`, all-argmax `[B]`)."""
        import jax

        if self._score is None:
            self._score = jax.jit(self._score_fn)
        with self.placement.op_environment():
            sums, greedy = self._score(self.loaded.params, tokens, targets, mask)
        return np.asarray(sums), np.asarray(greedy)

    def _score_fn(self, params, tokens, targets, mask):
        """The jitted step: the model's logits `[B, T, V]` -> per-row sums over `mask` (float32)."""
        import jax
        import jax.numpy as jnp

        from axcore.module import functional

        logits = functional(self.loaded.model, params, (tokens,), None, False, method="logits")[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logp, axis=-1) == targets
        return jnp.sum(picked * mask, axis=-1), jnp.all(hit | (mask == 0), axis=-1)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-probability, over disjoint windows of `max_length` tokens."""
        from lm_eval import utils

        rows, owner = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            windows = utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(utils.make_disjoint_window, windows):
                whole = list(context) + list(continuation)
                rows.append(Scored(whole[:-1], whole[1:], len(continuation)))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self.score(rows)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- Generation -------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut at the first of its stop strings (module docstring)."""
        eos = self.eot_token_id
        eos_text = self.tok_decode([eos]) if eos is not None else None
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        out = [""] * len(requests)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", DEFAULT_MAX_GEN_TOKS)))
            if max_new >= self.max_length:
                raise LmEvalError(f"A task asks for max_gen_toks={max_new} but the model takes {self.max_length} "
                                  f"tokens (max_length); lower the task's max_gen_toks or raise max_length.")
            sampling = _sampling(kwargs, max_new, [stop for stop in until if stop])
            prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_new)
                       or [self.prefix_token_id] for i in indices]  # An empty context: as in loglikelihood.
            for i, tokens in zip(indices, self._generate(prompts, sampling)):
                out[i] = cut_at_stops(self.tok_decode(tokens), until)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _generate(self, prompts: list[list[int]], sampling: Any) -> list[list[int]]:
        """The generated ids of each prompt (at most `sampling.max_tokens`, ending at the EOS id or the tokens
        of a stop string if one came): an offline engine of `batch_size` rows on the loaded parameters."""
        from axcore.engine.engine import Engine
        from axcore.engine.offline import offline_config, run_requests
        from axcore.engine.requests import GenerationRequest

        model, eos = self.loaded.model, self.eot_token_id
        config = offline_config(model, [len(p) for p in prompts], sampling.max_tokens, seed=self.seed,
                                max_seqs=self.batch_size)
        requests = [GenerationRequest(f"lm-eval-{i}", p, sampling) for i, p in enumerate(prompts)]
        with self.placement.op_environment():
            engine = Engine(model, self.loaded.params, self.tokenizer, config=config,
                            eos_token_ids=() if eos is None else (int(eos),))
            return [out.choices[0].token_ids for out in run_requests(engine, requests)]


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any non-empty stop string (all of it when none occurs)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def _sampling(kwargs: dict, max_new: int, stop: list[str]) -> Any:
    """The engine's `SamplingParams` of lm-eval generation kwargs: greedy unless `do_sample` with
    `temperature` > 0 (then `top_k`, `top_p`); `max_new` tokens at most, ending at the `stop` strings."""
    from axcore.engine.requests import SamplingParams, SamplingParamsError

    temperature = float(kwargs.get("temperature", 1.0 if kwargs.get("do_sample") else 0.0) or 0.0)
    if not kwargs.get("do_sample", temperature > 0) or temperature == 0:
        return SamplingParams(max_tokens=max_new, temperature=0.0, stop=tuple(stop))
    try:
        return SamplingParams(max_tokens=max_new, temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                              top_p=float(kwargs.get("top_p", 1.0)), stop=tuple(stop))
    except SamplingParamsError as e:
        raise LmEvalError(f"A task's generation_kwargs do not fit axcore's sampling: {e}") from None


def _positive(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise LmEvalError(f"The axcore lm-eval model's {name} must be a positive integer, got {value!r}.")
    return number


_REGISTERED: dict[str, type] = {}


def register() -> type:
    """Imports lm-eval, builds the `AxcoreLM` class (`AxcoreLMBase` over lm-eval's `TemplateLM`) and
    registers it as model `axcore`; idempotent. Raises LmEvalError when lm-eval is not installed."""
    if "class" not in _REGISTERED:
        lm_eval = import_lm_eval()
        cls = type("AxcoreLM", (AxcoreLMBase, lm_eval.api.model.TemplateLM), {
            "__doc__": AxcoreLMBase.__doc__, "__module__": __name__})
        _REGISTERED["class"] = lm_eval.api.registry.register_model(MODEL_NAME)(cls)
    return _REGISTERED["class"]


def __getattr__(name: str) -> Any:
    """`AxcoreLM`: the registered class (imports lm-eval, see `register`)."""
    if name == "AxcoreLM":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AxcoreLMBase", "LmEvalError", "Scored", "bucket_length", "cut_at_stops", "import_lm_eval", "register"]
