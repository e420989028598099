"""The hook specifications, one module per phase; `axcore.plugin.hookspecs` gathers them (`PHASES`).

- `extension`: hooks of a plugin's own, its experiments and commands (phases 0 and 1);
- `model`: layers, position embeddings, kernels and ops, model converters (phase 1);
- `data`: data sources and tokenizers (phase 1);
- `training`: optimizers, schedules, pipeline schedules, objectives, metrics writers (phase 1);
- `platform`: mesh rules, config modifiers, checkpoint backends (phase 1), and the
  machine and its compiler flags before the backend starts;
- `config`: a listed plugin's settings (phase 2) and config transform (phase 3).
"""
