"""Pure I/O of model files: model sources (builtin aliases, the Hub, object stores), GGUF conversion,
levanter checkpoints, PEFT adapters, LLaVA layouts. Nothing here imports a model."""
