"""One module per ``recpipe`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
