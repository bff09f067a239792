"""Whole models: the paged decoder over levanter modules and its per-family variants, checkpoint
loading, the text encoder, Whisper and the vision towers."""
