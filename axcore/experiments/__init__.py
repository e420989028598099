"""Built-in experiments: each `<name>.yaml` here is runnable as `axcore train <name>`."""
