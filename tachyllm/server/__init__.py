"""The OpenAI-compatible HTTP server: AsyncEngine (async_engine), the FastAPI app (app, assembling the
routers of routes/), its JSON models (protocol) and Prometheus metrics (metrics). `tachy serve`
(entrypoints/serve.py) runs it."""
