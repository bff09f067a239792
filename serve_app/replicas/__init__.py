"""What runs in a model-server replica: the replica template (base.py), one server per task, its
metrics and LoRA adapters."""
