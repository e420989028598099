"""The platform layer: instance types, meshes, logical-axis sharding, XLA flags and joining a multi-host job.

It owns what ties a run to its hardware and never to a model: parsing instance types
and matching mesh rules (`mesh`), mapping logical axis names to mesh axes and placing
parameters and batches (`sharding`), the XLA flag set (`xla_flags`), and starting
`jax.distributed` with the watch on lost peers (`distributed`, `peer_watch`). It may
import only the bottom layer (`errors`, `markers`, `config/`, `registry`) and `params`;
layers, the trainer, the plugin manager and experiments import it, never the reverse.
"""
