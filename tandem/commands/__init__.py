"""The `tandem` subcommands (tandem/cli.py wires them)."""
