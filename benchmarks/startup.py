"""Start-up: wall time of `axcore --help`, `axcore plugins` and `axcore config default`.

Each command runs as a fresh subprocess (the installed `axcore` console script),
with and without N extra dummy plugins installed in the `axcore` entry-point group.
"Installed" is simulated as in tests/plugin/test_entry_points.py: a directory on
PYTHONPATH holding `axcore_dummy<i>-0.1.dist-info/` folders (METADATA and
entry_points.txt `dummy<i> = axcore_dummy_<i>`) and tiny modules with one hookimpl
each. The baseline gets an *empty* directory on PYTHONPATH, so the two differ only
by the plugins. Each dummy module appends its name to $AXCORE_DUMMY_IMPORT_LOG
when imported, so the run also checks which commands import them.

All six contenders (3 commands x with/without) are alternated round by round; the
discovery overhead is the median of the per-round differences (with - without).
Because a 1.5 s process on this shared machine varies by +-0.2 s, the run also
times the discovery call alone (the first `installed_entry_points()` in a fresh
process), alternated with and without the plugins.

Targets: `--help` <= 0.3 s; the N plugins add <= 50 ms to `axcore config default`
(they are not in `plugins:`, so they must not even be imported). `axcore plugins`
imports every installed plugin to list its hooks; its overhead is reported too.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import alternate, axcore_command, summarize, timed, write_result

NAME = "startup"
COMMANDS = {"help": ["--help"], "plugins": ["plugins"], "config": ["config", "default"]}
# Discovery alone, in a fresh process: the first `installed_entry_points()` call
# (importlib.metadata scanning sys.path for the `axcore` group), which is all that
# `axcore config` does with plugins it does not enable.
_DISCOVERY_PROBE = (
    "import sys, time, axcore.plugin.loading as p; t = time.perf_counter(); eps = p.installed_entry_points(); "
    "sys.stdout.write(f'{time.perf_counter() - t} {len(eps)}')"
)
HELP_TARGET_S = 0.3
DISCOVERY_TARGET_S = 0.050




def make_dummy_plugins(directory: pathlib.Path, count: int) -> list[str]:
    """Writes `count` dummy plugin distributions into `directory`; returns their plugin names."""
    names = []
    for i in range(count):
        name, module = f"dummy{i}", f"axcore_dummy_{i}"
        dist_info = directory / f"axcore_dummy{i}-0.1.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: axcore-dummy{i}\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[axcore]\n{name} = {module}\n")
        (directory / f"{module}.py").write_text(textwrap.dedent(f"""\
            import os

            import axcore

            _log = os.environ.get("AXCORE_DUMMY_IMPORT_LOG")
            if _log:
                with open(_log, "a") as f:
                    f.write("{name}\\n")


            @axcore.hookimpl
            def axcore_register_layers(register):
                pass
        """))
        names.append(name)
    return names


def _runner(argv: list[str], env: dict[str, str]):
    def once() -> float:
        def call():
            proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")

        return timed(call)

    return once


def run(smoke: bool = False, results_dir: pathlib.Path | None = None, *, rounds: int | None = None,
        num_plugins: int | None = None) -> dict[str, Any]:
    """Times the three commands with and without dummy plugins, alternated; writes startup.json."""
    rounds = rounds or (1 if smoke else 15)
    num_plugins = num_plugins or (3 if smoke else 20)
    axcore = axcore_command()
    with tempfile.TemporaryDirectory(prefix="axcore-startup-") as tmp:
        tmp = pathlib.Path(tmp)
        empty, plugged = tmp / "empty", tmp / "plugins"
        empty.mkdir()
        plugged.mkdir()
        names = make_dummy_plugins(plugged, num_plugins)
        base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AXCORE_DISABLE_PLUGIN_AUTOLOAD")}
        envs = {
            "without": dict(base_env, PYTHONPATH=str(empty)),
            "with": dict(base_env, PYTHONPATH=str(plugged)),
        }
        contenders = {f"{cmd}/{which}": _runner(axcore + args, envs[which]) for cmd, args in COMMANDS.items() for which in envs}
        # One untimed pass of everything (warms the OS file cache and .pyc files); in it
        # the dummy plugins log their imports, so we learn which commands import them.
        imported: dict[str, int] = {}
        for cmd, args in COMMANDS.items():
            log = tmp / f"imports-{cmd}.log"
            _runner(axcore + args, envs["without"])()
            _runner(axcore + args, dict(envs["with"], AXCORE_DUMMY_IMPORT_LOG=str(log)))()
            imported[cmd] = len(log.read_text().split()) if log.exists() else 0
        times = alternate(contenders, rounds)

        # The discovery call alone (precise, where the end-to-end difference is noisy).
        found: dict[str, int] = {}

        def probe(which: str):
            def once() -> float:
                out = subprocess.run([sys.executable, "-c", _DISCOVERY_PROBE], env=envs[which], check=True,
                                     capture_output=True, text=True).stdout.split()
                found[which] = int(out[1])
                return float(out[0])

            return once

        discovery = alternate({"without": probe("without"), "with": probe("with")}, rounds)

    results = {name: summarize(ts) for name, ts in times.items()}
    overhead = {}
    for cmd in COMMANDS:
        diffs = [a - b for a, b in zip(times[f"{cmd}/with"], times[f"{cmd}/without"])]
        overhead[cmd] = {**summarize(diffs), "median_without_s": results[f"{cmd}/without"]["median"],
                         "median_with_s": results[f"{cmd}/with"]["median"]}
    help_s = max(results["help/without"]["median"], results["help/with"]["median"])
    config_overhead = overhead["config"]["median"]
    targets = {
        "help_wall_s": {
            "target": f"<= {HELP_TARGET_S}",
            "value": help_s,
            "metric": "median wall of `axcore --help` (worse of with/without plugins)",
            "met": help_s <= HELP_TARGET_S,
        },
        "discovery_overhead_s": {
            "target": f"<= {DISCOVERY_TARGET_S} for {num_plugins} plugins",
            "value": config_overhead,
            "metric": f"median per-round difference of `axcore config default` with - without {num_plugins} dummy plugins",
            "met": config_overhead <= DISCOVERY_TARGET_S and imported["config"] == 0,
            "dummy_plugins_imported": imported["config"],
        },
    }
    discovery_diffs = [a - b for a, b in zip(discovery["with"], discovery["without"])]
    data = {
        "smoke": smoke,
        "setup": {
            "command": " ".join(axcore),
            "rounds": rounds,
            "dummy_plugins": num_plugins,
            "dummy_plugin_names": names,
            "notes": "fresh subprocess per call; contenders alternated round by round after one untimed warm-up pass; "
            "baseline has an empty directory on PYTHONPATH",
        },
        "results": results,
        "overhead_with_plugins_s": overhead,
        "dummy_plugins_imported_by": imported,
        "discovery_call_s": {
            "what": "first installed_entry_points() call in a fresh process (importlib.metadata scan of the axcore group)",
            "without": summarize(discovery["without"]),
            "with": summarize(discovery["with"]),
            "added_by_plugins": summarize(discovery_diffs),
            "entry_points_found": found,
        },
        "targets": targets,
        "raw": {**times, **{f"discovery_call/{k}": v for k, v in discovery.items()}},
        "per_plugin_overhead_ms": {
            cmd: 1000 * statistics.median(
                [a - b for a, b in zip(times[f"{cmd}/with"], times[f"{cmd}/without"])]
            ) / num_plugins
            for cmd in COMMANDS
        },
    }
    write_result(NAME, data, results_dir=results_dir)
    return data


if __name__ == "__main__":
    import json

    print(json.dumps(run(smoke="--smoke" in sys.argv)["targets"], indent=2))
