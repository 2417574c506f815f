"""OpenAI endpoints, one package each: api_router (routes), protocol (pydantic models), serving
(request -> engine -> response)."""
