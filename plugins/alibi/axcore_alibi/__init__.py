"""axcore-alibi: ALiBi (Press et al. 2022, "Train Short, Test Long") in every attention layer.

Enable with `plugins: [alibi]`. Importing this package registers nothing; axcore
calls the hooks in `plugin`.
"""

from axcore_alibi.layer import AlibiBias, alibi_slopes

__all__ = ["AlibiBias", "alibi_slopes"]
