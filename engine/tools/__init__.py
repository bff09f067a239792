"""Offline tools that use the engine but never serve: the capacity planner and the TPU AOT compiler."""
