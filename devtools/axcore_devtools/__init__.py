"""Developer tools, outside the runtime package: the generated references
(`python -m axcore_devtools.hook_reference > docs/hooks.md`,
`python -m axcore_devtools.experiment_reference > docs/experiments.md`) and the plugins' integration
cost (`axcore loc`, `loc_report`). Nothing in axcore imports them but the `loc` command."""
