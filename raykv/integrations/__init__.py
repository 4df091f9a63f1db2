"""Serving-engine integrations (vLLM first). Each module imports its engine lazily."""
