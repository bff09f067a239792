"""Pure I/O of model files: model sources (builtin aliases, the Hub, object stores), checkpoint
configs (`ModelInfo`), GGUF conversion, levanter checkpoints, PEFT adapters, LLaVA files. Nothing
here imports a model, a layer, a backend or an engine (tests/unit/test_layout.py checks it)."""
