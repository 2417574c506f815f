"""Batch jobs: OpenAI's batch file format, a runner that sends each line through the server's own
routes in this process, and the on-disk store of uploaded files and batch records.

`kvtide run-batch` (cli.py) runs a file offline; the server's /v1/files and /v1/batches
(server/openai/batches/) run uploaded files beside interactive traffic, at a lower priority.
"""
