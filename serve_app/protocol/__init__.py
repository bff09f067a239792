"""The OpenAI request and response models, one module per API, and the context a request carries
from the ingress to a replica. Used by both processes: nothing here imports jax or transformers."""
