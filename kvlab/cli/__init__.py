"""The `kvlab` command: one module per subcommand, each with `register(subparsers)`."""
