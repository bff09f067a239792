"""Model sources: builtin aliases, GGUF conversion, resolving a name or path to a checkpoint."""
