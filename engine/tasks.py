"""The tasks a model can serve, by name: one engine package each (engine.generate, engine.embed,
engine.transcribe, engine.score). The only place the names are written; the serving layer's registry
(serve_app.tasks) says what each task serves and how."""

from __future__ import annotations

GENERATE = "generate"
"""Text generation: completions and chat (engine.generate)."""
EMBED = "embed"
"""Sentence embeddings (engine.embed)."""
TRANSCRIBE = "transcribe"
"""Speech to text (engine.transcribe)."""
SCORE = "score"
"""Relevance scores of (query, document) pairs: rerank and score (engine.score)."""
TASK_NAMES = (GENERATE, EMBED, TRANSCRIBE, SCORE)
