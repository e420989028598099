"""Each hardware package (`axcore_gpu/`, `axcore_tpu/`, `axcore_neuron/`) installs on its own
beside axcore with `pip install ./axcore_<name>`, and `pip uninstall` removes it, leaving
axcore working on CPU: with every package installed (each plugin's probe finds no device
of its kind, so JAX runs on CPU) and after all are removed, `axcore train` runs.

Runs in a virtual environment of its own that sees this environment's packages (axcore,
JAX, the feature plugins) through a .pth line, so pip installs and removes only the
hardware packages and this environment is never touched.
"""

import os
import pathlib
import shutil
import site
import subprocess
import venv

import pytest

from axcore.testing import TINY_OVERRIDES

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (source folder, distribution, plugin name) of each hardware package present in the checkout.
PACKAGES = [
    (folder, f"axcore-{platform}", platform)
    for platform in ("gpu", "tpu", "neuron")
    if (folder := ROOT / f"axcore_{platform}" / "pyproject.toml").exists()
]

pytestmark = pytest.mark.slow


def _run(python, *args, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH", "XLA_FLAGS")}
    out = subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert out.returncode == 0, f"{args}: {out.stdout[-1500:]}{out.stderr[-1500:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardware-install")
    venv.EnvBuilder(with_pip=True).create(root / "venv")  # pip from ensurepip: no network
    python = root / "venv" / "bin" / "python"
    inner_site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).strip()
    # This environment's site-packages, processed as a site dir (so its own .pth files, such
    # as axcore's editable install, work there too).
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
    pathlib.Path(inner_site, "outer.pth").write_text("\n".join(lines) + "\n")
    return python, root


def _train(python, root, name):
    run_dir = root / name
    overrides = [*TINY_OVERRIDES, "trainer.max_steps=2", "trainer.eval_every=0", f"trainer.run_dir={run_dir}"]
    args = ["-m", "axcore.cli", "train", "default"]
    for override in overrides:
        args += ["--set", override]
    _run(python, *args, cwd=root)
    return (run_dir / "config.yaml").read_text()


def _listed(listing: str, plugin: str, dist: str) -> bool:
    return any(line.split()[:2] == [plugin, dist] for line in listing.splitlines())


def test_each_package_installs_beside_axcore_and_uninstalls_cleanly(environment):
    python, root = environment
    assert [dist for _, dist, _ in PACKAGES][:1] == ["axcore-gpu"]  # At least the GPU package is here.
    for folder, dist, plugin in PACKAGES:
        source = root / folder.parent.name  # A copy: building writes egg-info next to the sources.
        shutil.copytree(folder.parent, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
        # Built in pip's isolated build environment, as `pip install ./plugins/*/` builds the plugins.
        _run(python, "-m", "pip", "install", "-q", "--no-deps", str(source), cwd=root)
        assert _listed(_run(python, "-m", "axcore.cli", "plugins", cwd=root), plugin, dist), dist
    # No accelerator here: every probe declines and JAX runs on CPU.
    assert "instance_type: cpu-" in _train(python, root, "installed")

    for _, dist, plugin in PACKAGES:
        _run(python, "-m", "pip", "uninstall", "-y", "-q", dist, cwd=root, timeout=120)
        assert not _listed(_run(python, "-m", "axcore.cli", "plugins", cwd=root), plugin, dist), dist
    assert "instance_type: cpu-" in _train(python, root, "uninstalled")
