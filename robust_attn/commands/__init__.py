"""Subcommands of the ``robust-attn`` CLI, one module each."""
