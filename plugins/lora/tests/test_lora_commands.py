"""`axcore lora init --help` shows the defaults an option left out takes (the lora plugin's settings)."""

import os
import re
import subprocess
import sys

from axcore_lora import LoraSettings


def test_init_help_shows_the_defaults():
    done = subprocess.run([sys.executable, "-m", "axcore.cli", "lora", "init", "--help"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the help lines.
    defaults = LoraSettings()
    for option in ("rank", "alpha", "dropout", "target", "base-format"):
        value = getattr(defaults, option.replace("-", "_"))
        assert re.search(rf"--{option}\b.*?\(.*?default: {re.escape(str(value))}\)", text), (option, text)
    assert "the lora plugin's" not in text  # The old help named no value.
