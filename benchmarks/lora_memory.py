"""Train-state memory of a SmolLM-135M-shaped Llama: full fine-tuning against LoRA and QLoRA (issue 25).

Abstract shapes only (`axcore_lora.memory.train_state_memory`: jax.eval_shape of the
train state, nothing allocated, no timing). The model is what `axcore convert
hf-to-axcore` builds from SmolLM-135M's config.json (d 576, 30 layers, 9 heads, 3 KV
heads, FFN 1536, vocab 49152, tied embeddings; float32 master weights, AdamW), with

- `full`: every parameter trains;
- `lora`: rank 16 on q|k|v|o|gate|up|down, the base frozen in float32;
- `qlora_int8` / `qlora_nf4`: the same, the targeted projections' base stored quantized
  (the embedding table and norms stay float32).

    python -m benchmarks.lora_memory            # prints the markdown table, writes results/lora_memory.json
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any

import yaml

from benchmarks.common import write_result

# SmolLM-135M's config.json (the fields the converter reads).
SMOLLM_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": True,
}
LORA = ["plugins=[rope, swiglu, lora]", "lora.rank=16", "lora.alpha=32", "lora.target=q|k|v|o|gate|up|down"]
VARIANTS = {
    "full": [],
    "lora": LORA,
    "qlora_int8": [*LORA, "lora.base_format=int8"],
    "qlora_nf4": [*LORA, "lora.base_format=nf4"],
}
COLUMNS = [
    ("parameters", "parameters"), ("trainable_parameters", "trainable"), ("params_bytes", "params"),
    ("optimizer_bytes", "optimizer state"), ("gradient_bytes", "gradients"), ("train_state_bytes", "train state"),
    ("base_bytes_per_parameter", "bytes / quantized base param"),
]


def measure(smoke: bool = False) -> dict[str, dict[str, Any]]:
    """Each variant's `train_state_memory` report (smoke: a 2-layer model of the same width)."""
    from axcore.experiment import load_experiment

    from axcore_hf.llama import LlamaConverter
    from axcore_lora.memory import train_state_memory

    config = dict(SMOLLM_135M, num_hidden_layers=2) if smoke else SMOLLM_135M
    data = {"name": "smollm_135m_shape", **LlamaConverter().experiment(config, "SmolLM-135M config.json")}
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "experiment.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), "utf-8")
        for name, overrides in VARIANTS.items():
            reports[name] = train_state_memory(load_experiment(path, overrides))
    return reports


def _mib(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def table(reports: dict[str, dict[str, Any]]) -> str:
    """The markdown table of README's "LoRA and QLoRA memory" section."""
    lines = ["| variant | " + " | ".join(title for _, title in COLUMNS) + " | vs full |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    full = reports["full"]["train_state_bytes"]
    for name, report in reports.items():
        cells = []
        for key, _ in COLUMNS:
            value = report[key]
            cells.append("-" if value is None else f"{value:,}" if key.endswith("parameters") and key != \
                         "base_bytes_per_parameter" else _mib(value) if key.endswith("_bytes") else str(value))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {report['train_state_bytes'] / full:.3f} |")
    return "\n".join(lines) + "\n"


def run(smoke: bool = False, results_dir: pathlib.Path | None = None) -> dict[str, Any]:
    reports = measure(smoke)
    full = reports["full"]["train_state_bytes"]
    headlines = [{"metric": f"{name} train state / full fine-tuning", "value": round(r["train_state_bytes"] / full, 4)}
                 for name, r in reports.items() if name != "full"]
    result = {"smoke": smoke, "model": SMOLLM_135M, "variants": VARIANTS, "reports": reports, "headlines": headlines}
    write_result("lora_memory", result, results_dir=results_dir)
    return result


if __name__ == "__main__":
    print(table(run()["reports"]), end="")
