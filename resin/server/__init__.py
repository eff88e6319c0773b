"""The OpenAI-compatible HTTP server (`resin run`): FastAPI + uvicorn over an engine stepping in its own thread."""
