"""The model: one forward pass over levanter modules (paged_model) and checkpoint loading."""
