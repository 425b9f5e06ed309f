"""The `tessera` command line: `main` builds the parser from the command modules here and runs one."""
