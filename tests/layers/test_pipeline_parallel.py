"""Pipeline parallelism over the `stage` mesh axis (axcore.layers.pipeline).

The 8-device checks (training matches one device, restore across stage counts, a schedule
added by a plugin) run in one subprocess, `pipeline_parallel_worker.py`, shared through a module
fixture; the schedule tables, their bubble and the config errors are checked here.
"""

import pathlib

import numpy as np
import pytest

from axcore.config import find
from axcore.errors import ConfigError, NoMatchError
from axcore.experiment import load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.layers import Circular, GPipe, PipelineSchedule
from axcore.layers.pipeline import bubble_fraction, check_table, checked_table, pipeline_plans, wavefront_table
from axcore.markers import hookimpl
from axcore.testing import TINY_OVERRIDES, run_host_device_worker

WORKER = pathlib.Path(__file__).parent / "pipeline_parallel_worker.py"
# Relative loss difference allowed at every one of the 20 steps (float32).
RTOL = 1e-5
PIPELINED = ["stage4_data2_gpipe", "stage4_data2_circular", "stage2_fsdp2_tensor2_gpipe",
             "stage2_fsdp2_tensor2_circular_accumulated_remat"]


@pytest.fixture(scope="module")
def results():
    return run_host_device_worker(WORKER, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINED)
def test_pipeline_matches_single_device_every_step(results, name):
    run = results["runs"][name]
    reference = results["runs"][run["reference"]]["losses"]
    assert len(run["losses"]) == len(reference) == 20
    for step, (got, want) in enumerate(zip(run["losses"], reference), 1):
        assert abs(got - want) <= RTOL * abs(want), f"{name} step {step}: {got} vs single-device {want}"
    assert reference[-1] < reference[0] - 1.0  # It trained.
    # The stacked layers are split over the stages (leading `layers` dim on the stage axis), one device holds all.
    assert run["layer_spec"].startswith("P('stage'")
    assert "stage" not in results["runs"]["single"]["layer_spec"]


@pytest.mark.slow
def test_train_start_logs_the_bubble(results):
    # GPipe, S = 4, M = 4: (S-1)/(M+S-1) = 3/7; circular, S = 2, M = 2, V = 2: 1/5.
    [line] = results["runs"]["stage4_data2_gpipe"]["log"]
    assert "model.decoder.pipeline: GPipe, 4 stages x 4 microbatches x 1 repeats in 7 steps" in line
    assert f"bubble {3 / 7:.4f}" in line
    [line] = results["runs"]["stage2_fsdp2_tensor2_circular_accumulated_remat"]["log"]
    assert f"in 5 steps, bubble {1 / 5:.4f}" in line
    assert results["runs"]["single"]["log"] == []


@pytest.mark.slow
def test_a_schedule_from_a_plugin_runs_on_8_devices(results):
    out = results["plugin_schedule"]
    # One microbatch at a time through 4 stages: bubble 3/4; the logits those of one device.
    [plan] = out["log"]
    assert "OneAtATime, 4 stages x 2 microbatches x 1 repeats in 8 steps, bubble 0.7500" in plan
    assert out["max_abs_diff"] <= 1e-5 * out["max_abs"], out


@pytest.mark.slow
def test_checkpoint_restores_across_stage_counts(results):
    out = results["restore"]
    # 4 stages -> 1 device -> 4 stages, bit for bit, each into its own layout.
    assert out["to_1_equal"] and out["back_to_4_equal"]
    assert "stage" not in out["spec_on_1"] and out["spec_on_4"].startswith("P('stage'")
    # Training continues on 4 stages as it does on one device from the same restored state.
    assert len(out["losses_4"]) == len(out["losses_1_continued"]) == 2
    for got, want in zip(out["losses_4"], out["losses_1_continued"]):
        assert abs(got - want) <= RTOL * abs(want), (out["losses_4"], out["losses_1_continued"])


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 4, 8, 16])
def test_gpipe_bubble_is_the_formula(stages, microbatches):
    table = GPipe(GPipe.default_config().set(microbatches=microbatches)).table(stages)
    assert check_table(table, stages, microbatches, 1) == []
    assert bubble_fraction(table) == pytest.approx((stages - 1) / (microbatches + stages - 1), abs=1e-12)
    # Every stage idles the same number of slots: S - 1.
    assert set((table[..., 0] < 0).sum(axis=0).tolist()) == {stages - 1}


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 2), (4, 4, 2), (4, 8, 3), (8, 8, 4), (3, 5, 2)])
def test_circular_bubble_is_the_formula(stages, microbatches, repeats):
    schedule = Circular(Circular.default_config().set(microbatches=microbatches, repeats=repeats))
    table = schedule.table(stages)
    assert check_table(table, stages, microbatches, repeats) == []
    want = (stages - 1) / (repeats * microbatches + stages - 1)
    assert bubble_fraction(table) == pytest.approx(want, abs=1e-12)
    # Stage s runs groups v*S + s in order of v for every microbatch: V trips around the ring.
    for s in range(stages):
        slots = [tuple(x) for x in table[:, s].tolist() if x[0] >= 0]
        assert sorted(slots) == [(m, v) for m in range(microbatches) for v in range(repeats)]


def test_check_table_rejects_broken_dataflow():
    table = wavefront_table(3, 2, 1)
    skewed = table.copy()
    skewed[:, 1] = np.roll(table[:, 1], -1, axis=0)  # Stage 1 starts when stage 0 has not finished.
    assert "was not finished by stage 0" in check_table(skewed, 3, 2, 1)[0]
    early = wavefront_table(4, 2, 2)  # Two microbatches cannot keep four stages busy: a trip returns too late.
    assert "starts before stage 3 finished" in check_table(early, 4, 2, 2)[0]
    missing = table.copy()
    missing[-1, 2] = -1
    assert "never run" in check_table(missing, 3, 2, 1)[0]


def test_schedule_errors_name_the_config_path():
    circular = Circular(Circular.default_config().set(microbatches=2, repeats=2))
    with pytest.raises(ConfigError, match=r"model\.decoder\.pipeline: microbatches \(2\) is below the 4 stages"):
        checked_table(circular, 4, 8, "model.decoder.pipeline")
    gpipe = GPipe(GPipe.default_config().set(microbatches=2))
    with pytest.raises(ConfigError, match=r"model\.decoder\.pipeline: the 6 stacked units do not split into 4 stages"):
        checked_table(gpipe, 4, 6, "model.decoder.pipeline")


class Reverse(PipelineSchedule):
    """A further schedule: GPipe feeding the microbatches last to first."""

    def table(self, num_stages):
        table = wavefront_table(num_stages, self.microbatches, 1)
        table[..., 0] = np.where(table[..., 0] >= 0, self.microbatches - 1 - table[..., 0], -1)
        return table


class ReversePlugin:
    @hookimpl
    def axcore_register_pipeline_schedules(self, register):
        register("reverse", Reverse)


def test_a_plugin_adds_a_schedule_that_the_modifier_and_report_use():
    registries = create_plugin_manager(["reverse"], objects={"reverse": ReversePlugin()}).registries
    assert registries.pipeline_schedules["reverse"] is Reverse
    rule = ("mesh_rules=[{name: staged, instance_type: '.*', mesh_shape: [2, -1], mesh_axis_names: [stage, data], "
            "modifiers: [{type: pipeline, schedule: reverse, microbatches: 3}]}]")
    # 12 rows: 3 on each of the data axis's 4 devices, one per microbatch (config refuses fewer).
    exp = load_experiment("scan", [*TINY_OVERRIDES, "plugins=[reverse]", "mesh.instance_type=cpu-8", "input.batch_size=12", rule],
                          objects={"reverse": ReversePlugin()})
    [(path, schedule)] = find(exp.config.model, PipelineSchedule)
    assert path == "decoder.pipeline" and schedule.klass is Reverse and schedule.microbatches == 3
    [plan] = pipeline_plans(exp.config.model, {"stage": 2, "data": 4})
    assert (plan.path, plan.stages, plan.microbatches, plan.steps) == ("model.decoder.pipeline", 2, 3, 4)
    assert plan.bubble == pytest.approx(1 / 4)
    assert pipeline_plans(exp.config.model, {"data": 8}) == []  # No stage axis: no pipeline.


def test_compile_report_gives_the_bubble(monkeypatch):
    from axcore.cli import compile as compile_cli
    from axcore.trainer import compile_analysis

    exp = load_experiment("scan", [*TINY_OVERRIDES, "mesh.instance_type=cpu-8",
                                   "model.decoder.pipeline={type: circular, microbatches: 8, repeats: 3}"])
    step = compile_analysis.CompiledStep(None, {}, 0, 0.0, 0.0, 8, {"stage": 4, "data": 2})
    monkeypatch.setattr(compile_analysis, "compile_step", lambda experiment: step)
    report = compile_cli.compile_report(exp)
    assert report["pipeline_bubble"] == pytest.approx(3 / (3 * 8 + 3), abs=1e-6)
    assert "Circular, 4 stages x 8 microbatches x 3 repeats in 27 steps" in report["notes"]["pipeline_bubble"]


def test_pipeline_modifier_refuses_unknown_schedules_and_stackless_models():
    rule = "mesh_rules=[{name: staged, instance_type: '.*', modifiers: [{type: pipeline, schedule: gpip}]}]"
    with pytest.raises(ConfigError, match=r"no pipeline schedule named 'gpip' \(did you mean 'gpipe'\?\)"):
        load_experiment("scan", [*TINY_OVERRIDES, "mesh.instance_type=cpu-1", rule])
    rule = "mesh_rules=[{name: staged, instance_type: '.*', modifiers: [{type: pipeline}]}]"
    with pytest.raises(NoMatchError, match="no scanned layer stack"):
        load_experiment(None, [*TINY_OVERRIDES, "mesh.instance_type=cpu-1", rule])
