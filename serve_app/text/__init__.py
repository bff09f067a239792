"""Text handling in a model-server replica: tokenizer, incremental detokenizing, stream batching,
responses, tool calls and reasoning."""
