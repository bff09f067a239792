"""The ingress's routes, one router per family: completions and chat, embeddings, audio, tokens
(/tokenize, /detokenize), models, LoRA adapters, health and metrics. `create_app`
(serve_app.http.ingress) mounts them; each route reads what the app serves with
`serve_app.http.served.served`."""
