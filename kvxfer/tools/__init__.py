"""The `kvxfer` command's subcommands, one module each (imported on use)."""
