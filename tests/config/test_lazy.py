"""axcore/config/lazy.py: the literal `__all__` a package's lazy map is derived from."""

import pytest

from axcore.config.lazy import declared_all


def test_declared_all_refuses_a_module_without_a_literal_list(tmp_path):
    source = tmp_path / "computed.py"
    source.write_text("names = ['a']\n__all__ = list(names)\n")
    with pytest.raises(ValueError, match="literal"):
        declared_all(str(source))
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="states no literal __all__"):
        declared_all(str(tmp_path / "none.py"))
