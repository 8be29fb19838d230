"""OpenAI-compatible HTTP server: FastAPI app, pydantic schemas, and the generation engine."""
