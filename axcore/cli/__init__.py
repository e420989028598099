"""The command line: `axcore <command>`, one module per built-in command.

It owns parsing (`app`: the parser, the dispatch, plugin commands, one-line errors and
exit codes; `common`: what the commands share) and each command's work: `train`,
`config` (with the `shardings` report), `plugins`, `compile`, `loc`, `new_plugin` (the
plugin scaffold), `eval`, `generate` and `prepare`. It is the top layer: it may import
every other package of axcore (`tools/` included), and nothing in axcore imports it.
`main` (the `axcore` console script), `build_parser` and `COMMANDS` are re-exported
from `app`, which imports only argparse and the command names, so `axcore --help`
never imports JAX.
"""

from __future__ import annotations

from axcore.cli.app import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
