"""What runs in the ingress replica: the OpenAI routes, request limits, model states, routing,
adapter routes and the ingress's metrics. Nothing here imports jax or transformers."""
