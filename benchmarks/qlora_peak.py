"""Peak memory of the LoRA and QLoRA train step of a SmolLM-135M-shaped Llama (issue 34).

`benchmarks/lora_memory.py` predicts the train state (params, optimizer, gradients) from
abstract shapes; this measures the compiled step, built in process from SmolLM-135M's
config.json (nothing downloaded), for `lora` (rank 16 on q|k|v|o|gate|up|down, the base
float32) and `qlora_int8` / `qlora_nf4` (the same, those projections stored quantized):

- `argument` / `temp` / `peak`: XLA's `memory_analysis()` of the compiled train step
  (state donated): argument bytes (the train state and batch), temporaries (activations,
  residuals, anything else the step holds), and their sum, the step's peak;
- `predicted`: `axcore lora memory`'s train state (params + optimizer + gradients);
- with `--run`: `rss_peak`, the peak resident set of a fresh process that initialises the
  state and runs `--steps` steps (`resource.getrusage`; includes Python, JAX and XLA's own
  memory, about the same for every variant).

A float copy of the quantized base kept by the step shows as QLoRA's `temp` above LoRA's
(`axcore_lora.kernel.quantized_dot` explains why it no longer is).

    python -m benchmarks.qlora_peak [--layers 30] [--batch 2 --seq 256] [--run]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
from typing import Any

import yaml

from benchmarks.common import write_result
from benchmarks.lora_memory import LORA, SMOLLM_135M

VARIANTS = {"lora": LORA, "qlora_int8": [*LORA, "lora.base_format=int8"], "qlora_nf4": [*LORA, "lora.base_format=nf4"]}


def _experiment(variant: str, layers: int, batch: int, seq: int):
    from axcore.experiment import load_experiment

    from axcore_hf.llama import LlamaConverter

    data = {"name": "smollm_135m_shape",
            **LlamaConverter().experiment(dict(SMOLLM_135M, num_hidden_layers=layers), "SmolLM-135M config.json")}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "experiment.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), "utf-8")
        return load_experiment(path, [*VARIANTS[variant], f"input.batch_size={batch}", f"input.seq_len={seq}",
                                      "trainer.sample.num_tokens=0"])


def compiled(variant: str, layers: int, batch: int, seq: int) -> dict[str, int]:
    """`memory_analysis()` of the variant's compiled train step and the predicted train state, in bytes."""
    from axcore.trainer.compile_analysis import compile_step

    from axcore_lora.memory import train_state_memory

    experiment = _experiment(variant, layers, batch, seq)
    sizes = compile_step(experiment).memory
    argument, temp = sizes["argument"], sizes["temp"]
    return {"argument": argument, "temp": temp, "peak": argument + temp,
            "predicted": train_state_memory(experiment)["train_state_bytes"]}


def rss_peak(variant: str, layers: int, batch: int, seq: int, steps: int) -> int:
    """Peak RSS (bytes) of this process after initialising the variant's state and running `steps` steps."""
    import jax
    import numpy as np

    from axcore.trainer.step import TrainStep

    step = TrainStep(_experiment(variant, layers, batch, seq))
    state = step.init_state()
    ids = np.random.default_rng(0).integers(0, SMOLLM_135M["vocab_size"], (batch, seq), dtype=np.int32)
    batch_data = {"input_ids": ids, "target_labels": np.roll(ids, -1, axis=1), "target_weights": np.ones(ids.shape, np.float32),
                  "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy(),
                  "segment_ids": np.ones(ids.shape, np.int32)}
    train = step.compiled_train_step()
    for _ in range(steps):
        state, metrics = train(state, batch_data)
    jax.block_until_ready(metrics["loss"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB.


def run(layers: int = 30, batch: int = 2, seq: int = 256, measure_rss: bool = False, steps: int = 2,
        results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    reports = {}
    for variant in VARIANTS:
        reports[variant] = compiled(variant, layers, batch, seq)
        if measure_rss:  # A fresh process each, so one variant's peak does not hide another's.
            out = subprocess.run([sys.executable, "-m", "benchmarks.qlora_peak", "--rss-of", variant,
                                  f"--layers={layers}", f"--batch={batch}", f"--seq={seq}", f"--steps={steps}"],
                                 capture_output=True, text=True, check=True)
            reports[variant]["rss_peak"] = int(out.stdout.strip().splitlines()[-1])
    lora = reports["lora"]["peak"]
    headlines = [{"metric": f"{name} compiled step peak / lora", "value": round(r["peak"] / lora, 4)}
                 for name, r in reports.items() if name != "lora"]
    result = {"layers": layers, "batch": batch, "seq": seq, "reports": reports, "headlines": headlines}
    write_result("qlora_peak", result, results_dir=results_dir)
    return result


def table(reports: dict[str, dict[str, int]]) -> str:
    keys = [k for k in ("argument", "temp", "peak", "predicted", "rss_peak") if k in reports["lora"]]
    lines = ["| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, r in reports.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[k] / 2**20:,.1f} MiB" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM-135M: 30)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--run", action="store_true", help="also run each variant in a fresh process: peak RSS")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rss-of", dest="rss_of", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_of:
        print(rss_peak(args.rss_of, args.layers, args.batch, args.seq, args.steps))
        return
    result = run(args.layers, args.batch, args.seq, args.run, args.steps)
    print(json.dumps(result["headlines"]))
    print(table(result["reports"]), end="")


if __name__ == "__main__":
    main()
