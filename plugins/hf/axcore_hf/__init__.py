"""axcore-hf: import and export Hugging Face Llama-family checkpoints (safetensors).

`axcore convert hf-to-axcore HF_DIR OUT` and `axcore convert axcore-to-hf RUN OUT`;
the same from code with `hf_to_axcore` and `axcore_to_hf`. Importing this package
registers nothing; axcore calls the hooks in `axcore_hf.plugin`.
"""

from axcore_hf.convert import axcore_to_hf, find_converter, hf_to_axcore
from axcore_hf.llama import LlamaConverter

__all__ = ["LlamaConverter", "axcore_to_hf", "find_converter", "hf_to_axcore"]
