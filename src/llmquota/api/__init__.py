"""The REST adapter: FastAPI routes over the Limiter."""
