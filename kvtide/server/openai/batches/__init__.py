"""/v1/files and /v1/batches: OpenAI's batch jobs, run inside the server at a lower priority than
interactive requests (serving.py says how)."""
