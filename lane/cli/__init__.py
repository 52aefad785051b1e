"""The `lanefuse` command: its entry, options, subcommands, reports, and what a MODEL argument names. The only room
that reads the command line; stands on `explore` and `run`."""
