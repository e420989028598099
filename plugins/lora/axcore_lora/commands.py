"""`axcore lora`: PEFT adapter export and import, and the merged model (`axcore_lora.peft`).

    axcore lora init BASE_RUN OUT [--rank R --alpha A --dropout D --target REGEX --base-format nf4]  # fresh adapters
    axcore lora export-peft RUN OUT [--step N]     # a LoRA run's adapters -> PEFT adapter directory
    axcore lora import-peft BASE_RUN ADAPTER OUT   # base run + PEFT adapter -> LoRA run directory
    axcore lora merge RUN OUT [--step N]           # adapters folded into the weights -> plain run
    axcore lora memory EXPERIMENT [--set P=V ...]  # train-state bytes (params, optimizer, gradients)
"""

from __future__ import annotations

import argparse

from axcore.plugin.commands import add_experiment, overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sub-commands and their arguments; `lora init --help` shows the defaults (`LoraSettings`')."""
    from axcore_lora.kernel import LoraSettings

    defaults = LoraSettings()
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="a base run plus fresh adapters (B = 0) -> a LoRA run directory to train")
    init.add_argument("base_run", help="the base model's run directory (e.g. from axcore convert hf-to-axcore)")
    init.add_argument("out", help="new run directory (train it with axcore train OUT/config.yaml)")
    for name, kind, doc in [("rank", int, "adapter rank"), ("alpha", float, "scale numerator (alpha / rank)"),
                            ("dropout", float, "dropout on the adapter's input"),
                            ("target", str, "regex fully matching the sites' short names")]:
        shown = str(getattr(defaults, name)).replace("%", "%%")
        init.add_argument(f"--{name}", type=kind, default=None, help=f"{doc} (default: {shown})")
    init.add_argument("--base-format", dest="base_format", choices=["float", "int8", "nf4"], default=None,
                      help=f"store the targeted projections' frozen base quantized (QLoRA; default: "
                           f"{defaults.base_format})")
    init.add_argument("--adapters-only", action="store_true",
                      help="checkpoints hold the adapters only; the base is read from BASE_RUN (or, quantized, OUT/base)")
    export = sub.add_parser("export-peft", help="write a LoRA run's adapters as a PEFT adapter directory")
    export.add_argument("run", help="LoRA run directory (or a step directory)")
    export.add_argument("out", help="directory to write adapter_config.json and adapter_model.safetensors into")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    imp = sub.add_parser("import-peft", help="a base run plus a PEFT adapter -> a LoRA run directory")
    imp.add_argument("base_run", help="the base model's run directory (e.g. from axcore convert hf-to-axcore)")
    imp.add_argument("adapter", help="PEFT adapter directory")
    imp.add_argument("out", help="new run directory")
    merge = sub.add_parser("merge", help="fold a LoRA run's adapters into its weights (a run without lora)")
    merge.add_argument("run", help="LoRA run directory (or a step directory)")
    merge.add_argument("out", help="new run directory (export it with axcore convert axcore-to-hf)")
    merge.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    memory = sub.add_parser("memory", help="train-state memory from abstract shapes: params (adapters, frozen "
                            "base, quantized base), optimizer state, gradients, bytes per base parameter")
    add_experiment(memory, required=True)


def run(args: argparse.Namespace) -> int:
    if args.action == "memory":
        from axcore.experiment import load_experiment

        from axcore_lora.memory import format_memory, train_state_memory  # Deferred: JAX.

        print(format_memory(train_state_memory(load_experiment(args.experiment, overrides(args)))), end="")
        return 0
    from axcore_lora import peft  # Deferred: JAX and the checkpoint machinery.

    if args.action == "init":
        names = ("rank", "alpha", "dropout", "target", "base_format")
        settings = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
        if args.adapters_only:
            settings["checkpoint"] = "adapters"
        out = peft.init(args.base_run, args.out, settings)
    elif args.action == "export-peft":
        out = peft.export_peft(args.run, args.out, step=args.step)
    elif args.action == "import-peft":
        out = peft.import_peft(args.base_run, args.adapter, args.out)
    else:
        out = peft.merge(args.run, args.out, step=args.step)
    print(f"wrote {out}")
    return 0
