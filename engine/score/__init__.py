"""Rerank and score: the score engine (engine.py) and its async driver (driver.py)."""
