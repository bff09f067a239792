"""Media a model-server replica reads: images, audio, and words with their timestamps."""
