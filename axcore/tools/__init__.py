"""Developer tools: the generated references (`python -m axcore.tools.hook_reference > docs/hooks.md`,
`python -m axcore.tools.experiment_reference > docs/experiments.md`) and the plugins' integration
cost (`axcore loc`, `loc_report`). Nothing else in axcore imports them but the `loc` command."""
