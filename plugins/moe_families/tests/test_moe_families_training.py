"""Plugin moe_families: fine-tuning resumes from an import, also with expert parallelism.

Each family's tiny model (moe_family_models.py) is imported and trained 5 steps by
`axcore train` on one device; its last step exports to a model transformers loads with
axcore's logits. The Qwen3-MoE import also trains in a subprocess on 8 host devices, the
experts split 4 ways over an `expert` mesh axis and the batch 2 ways over `data`
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), with the one-device run's losses at
every step.
"""

import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("axcore_moe_families")

from moe_family_models import CONFIGS, TOLERANCE, axcore_logits, hf_logits, save_hf  # noqa: E402

from axcore.cli import main  # noqa: E402
from axcore.observe import read_jsonl_metrics  # noqa: E402
from axcore.testing import host_devices_env  # noqa: E402

from axcore_hf import hf_to_axcore  # noqa: E402

STEPS = 5
OVERRIDES = [
    f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.sample.num_tokens=0", "input.batch_size=4",
    "trainer.learner.schedule.warmup_steps=0", "trainer.log_every=1", "trainer.metrics_writers=[{type: jsonl}]",
]
# The experts split 4 ways, the batch 2 ways (8 devices).
EXPERT_MESH = ["mesh.instance_type=cpu-8", "mesh.mesh_shape=[2,4]", "mesh.mesh_axis_names=[data,expert]"]
# Relative loss difference allowed between the two meshes at every step (float32; measured 2.1e-7).
RTOL = 1e-5


def _train_args(run, extra=()):
    sets = [f"trainer.run_dir={run}", *OVERRIDES, *extra]
    return ["train", str(run / "config.yaml"), *[a for s in sets for a in ("--set", s)]]


def _losses(run):
    return [r["train/loss"] for r in read_jsonl_metrics(run / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fine_tuning_resumes_from_the_import_and_exports(name, tmp_path, capsys):
    model = save_hf(tmp_path / "hf", CONFIGS[name]())
    hf_to_axcore(tmp_path / "hf", tmp_path / "import")
    shutil.copytree(tmp_path / "import", tmp_path / "one")
    expert_parallel = None
    if name == "qwen3_moe":  # The same steps on 4 devices, in a subprocess started before this one trains.
        shutil.copytree(tmp_path / "import", tmp_path / "eight")
        env = host_devices_env(8)
        code = "import sys; from axcore.cli import main; sys.exit(main(sys.argv[1:]))"
        args = [sys.executable, "-c", code, *_train_args(tmp_path / "eight", EXPERT_MESH)]
        expert_parallel = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert main(_train_args(tmp_path / "one")) == 0
    assert "Resumed from step 0" in capsys.readouterr().err
    assert main(["convert", "axcore-to-hf", str(tmp_path / "one"), str(tmp_path / "out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    trained = axcore_logits(tmp_path / "one", step=STEPS)
    assert np.abs(trained - hf_logits(model)).max() > 1e-3  # Training changed the model...
    assert np.abs(trained - hf_logits(exported)).max() < TOLERANCE  # ...and the export is that model.
    if expert_parallel is not None:
        _, err = expert_parallel.communicate(timeout=300)
        assert expert_parallel.returncode == 0, err[-3000:]
        resolved = (tmp_path / "eight" / "config.txt").read_text()
        assert "mesh.mesh_shape: [2, 4]" in resolved and "mesh.mesh_axis_names: [data, expert]" in resolved
        one, eight = _losses(tmp_path / "one"), _losses(tmp_path / "eight")
        assert len(one) == len(eight) == STEPS and one[-1] < one[0]
        for step, (got, want) in enumerate(zip(eight, one), 1):
            assert abs(got - want) <= RTOL * abs(want), f"step {step}: 8 devices {got} vs one {want}"
