"""Embeddings: the embedding engine (engine.py) and its async driver (driver.py)."""
