"""The `hf` plugin: Llama-family model converters and the `axcore convert` command.

Registers converters for the Hugging Face model types `llama` and `mistral` (hook
`axcore_register_model_converters`) and the command `axcore convert` (hook
`axcore_register_commands`). Importing this module registers nothing: axcore calls
the hooks. Other plugins add model families by registering converters of their own.
"""

import axcore

from axcore_hf import convert
from axcore_hf.llama import LlamaConverter

# Needs the axcore_register_model_converters hook (plugin API 1.1).
AXCORE_PLUGIN_API = ">=1.1,<2"


@axcore.hookimpl
def axcore_register_model_converters(register):
    register("llama", LlamaConverter())
    register("mistral", LlamaConverter(model_type="mistral", architecture="MistralForCausalLM", sliding_window=True))


@axcore.hookimpl
def axcore_register_commands(register):
    register(
        "convert",
        convert.run,
        add_arguments=convert.add_arguments,
        help="convert between Hugging Face model directories and axcore runs (hf-to-axcore, axcore-to-hf)",
    )
