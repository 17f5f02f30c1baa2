"""OpenAI-compatible HTTP server: FastAPI app (app.py), protocol models, SSE streaming, auth, errors,
and the `tokenloom serve` command (cli.py)."""
