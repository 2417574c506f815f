"""`kvtide router`: one OpenAI-compatible endpoint in front of many `kvtide serve` (or any
OpenAI-compatible) backends.

    client ──HTTP──▶ router ──▶ policy picks a healthy backend ──▶ backend (streams relayed as they come)
                       │            round_robin | least_load | cache_aware (prefix index per backend)
                       ├─ health loop: GET /health per backend; failures eject, 200 re-admits
                       ├─ retries: connection error or 503 (draining) before a byte reached the client
                       └─ prefill/decode: prefill pool (max_tokens 1) then decode pool

One concern per module: settings (`config`), backend state (`backends`), the prefix index
(`prefix_index`), policies (`policies`), the health loop (`health`), metrics (`metrics`), OpenAI
error bodies (`errors`), API-key check (`auth`), relaying one request (`proxy`), prefill/decode
(`disagg`), the FastAPI app (`app`) and the command line (`cli`). Nothing here imports torch.
"""
