"""Which kernel each op call gets and why the kernels tried before it declined
(`Experiment.kernel_decisions`, `axcore config --kernels`), for this machine or a selected target."""

import pytest

import axcore
from axcore.cli import main
from axcore.errors import KernelNotSupportedError
from axcore.experiment import load_experiment
from axcore.kernels import ATTENTION, XlaAttention, format_kernel_decisions
from axcore.kernels.registry import KernelDecision


class FussyAttention(XlaAttention):
    """Declines causal attention on the cpu platform; otherwise the reference math (priority 5)."""

    name = "fussy"
    priority = 5

    def is_supported(self, problem):
        if problem.platform == "cpu":
            return axcore.kernels.Support(False, "wants an accelerator")
        return super().is_supported(problem)


class Fussy:
    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register(ATTENTION, FussyAttention())


OBJECTS = {"fussy": Fussy()}


def test_decisions_name_every_site_and_the_reasons_of_earlier_kernels():
    decisions = load_experiment("default", ["plugins=[fussy]"], objects=OBJECTS).kernel_decisions()
    attention = [d for d in decisions if d.op == "attention"]
    assert [d.site for d in attention] == [f"model.decoder.layer{i}.self_attention.attention" for i in range(4)]
    no_context = "no 'context' mesh axis of size > 1"  # The built-in context-parallel kernels decline first.
    declined = (("context_all_gather", no_context), ("context_ring", no_context), ("fussy", "wants an accelerator"))
    assert {(d.kernel, d.declined) for d in attention} == {("xla", declined)}
    dots = [d for d in decisions if d.op == "dot"]
    assert len(dots) == 25 and {d.kernel for d in dots} == {"xla"}  # xla_cpu is opt-in.


def test_a_selected_instance_type_is_the_platform_kernels_answer_for():
    # Resolved for a TPU on this CPU machine: problems say platform tpu, so the fussy kernel runs;
    # asked for, the CPU-only dot kernel declines with its reason.
    experiment = load_experiment("default", ["plugins=[fussy]", "mesh.instance_type=tpu-v5p-8"], objects=OBJECTS)
    decisions = experiment.kernel_decisions()
    assert {d.kernel for d in decisions if d.op == "attention"} == {"fussy"}
    dot = next(d for d in decisions if d.op == "dot")
    assert dot.kernel == "xla" and dot.declined == ()
    with pytest.raises(KernelNotSupportedError, match="only for the cpu platform, not tpu"):
        forced = ["plugins=[fussy]", "mesh.instance_type=tpu-v5p-8", "model.kernels={dot: xla_cpu}"]
        load_experiment("default", forced, objects=OBJECTS).kernel_decisions()


def test_a_forced_kernel_is_marked_forced():
    overrides = ["plugins=[fussy]", "mesh.instance_type=tpu-v5p-8", "model.decoder.layer.self_attention.kernels={attention: xla}"]
    decisions = load_experiment("default", overrides, objects=OBJECTS).kernel_decisions()
    assert {(d.kernel, d.forced) for d in decisions if d.op == "attention"} == {("xla", True)}


def test_format_groups_sites_with_the_same_choice_and_reasons():
    decisions = [
        KernelDecision("attention", "a.0", "xla", (("fast", "no"),)),
        KernelDecision("attention", "a.1", "xla", (("fast", "no"),)),
        KernelDecision("dot", "d.0", "int8", (), True),
    ]
    assert format_kernel_decisions(decisions) == (
        "attention -> xla  (2 sites)\n  site a.0\n  site a.1\n  declined fast: no\n"
        "dot -> int8  (forced by the layer's kernels setting)\n  site d.0\n"
    )


def test_config_kernels_prints_the_decisions(capsys):
    assert main(["config", "default", "--set", "plugins=[fussy]", "--kernels"], objects=OBJECTS) == 0
    out = capsys.readouterr().out
    assert "attention -> xla  (4 sites)" in out and "  declined fussy: wants an accelerator" in out
    assert "model.embedding" not in out.split("dot ->")[0]  # Config lines are not printed.
