"""Subcommand modules in the shape of ``megatron_serve.cli.COMMANDS`` (add_arguments / run)."""
