"""`pip install ./axcore_gpu` beside axcore, then `pip uninstall axcore-gpu`: axcore keeps
working on CPU with the package installed (the gpu plugin's probe finds no GPU and JAX
runs on CPU) and after it is removed.

Runs in a virtual environment of its own that sees this environment's packages (axcore,
JAX, the feature plugins) through a .pth line, so pip installs and removes only axcore-gpu
and this environment is never touched.
"""

import os
import pathlib
import shutil
import site
import subprocess
import venv

import pytest
import tiny

GPU_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "axcore_gpu"


def _run(python, *args, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH", "XLA_FLAGS")}
    out = subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert out.returncode == 0, f"{args}: {out.stdout[-1500:]}{out.stderr[-1500:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-install")
    venv.EnvBuilder(with_pip=True).create(root / "venv")  # pip from ensurepip: no network
    python = root / "venv" / "bin" / "python"
    inner_site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).strip()
    # This environment's site-packages, processed as a site dir (so its own .pth files, such
    # as axcore's editable install, work there too).
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
    pathlib.Path(inner_site, "outer.pth").write_text("\n".join(lines) + "\n")
    source = root / "axcore_gpu"  # A copy: building writes egg-info next to the sources.
    shutil.copytree(GPU_PACKAGE, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    return python, source, root


def _train(python, root, name):
    run_dir = root / name
    overrides = [*tiny.TINY, "trainer.max_steps=2", "trainer.eval_every=0", f"trainer.run_dir={run_dir}"]
    args = ["-m", "axcore.cli", "train", "default"]
    for override in overrides:
        args += ["--set", override]
    _run(python, *args, cwd=root)
    return (run_dir / "config.yaml").read_text()


def test_install_then_uninstall_leaves_axcore_working_on_cpu(environment):
    python, source, root = environment
    # Built in pip's isolated build environment, as `pip install ./plugins/*/` builds the plugins.
    _run(python, "-m", "pip", "install", "-q", "--no-deps", str(source), cwd=root)

    listing = _run(python, "-m", "axcore.cli", "plugins", cwd=root)
    assert any(line.split()[:2] == ["gpu", "axcore-gpu"] for line in listing.splitlines()), listing
    config = _train(python, root, "installed")
    assert "instance_type: cpu-" in config  # No GPU here: the probe declined and JAX ran on CPU.

    _run(python, "-m", "pip", "uninstall", "-y", "-q", "axcore-gpu", cwd=root, timeout=120)
    listing = _run(python, "-m", "axcore.cli", "plugins", cwd=root)
    assert "axcore-gpu" not in listing
    assert "instance_type: cpu-" in _train(python, root, "uninstalled")
