"""One module per ``megatron-serve`` subcommand."""
