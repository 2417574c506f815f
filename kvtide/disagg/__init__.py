"""KV connectors: KV cache blocks that live beyond one engine's device pool.

    scheduler ──▶ KVConnectorScheduler          model runner ──▶ KVConnectorWorker
      which tokens of a request exist outside       before the forward: copy out blocks the pool
      the device (and where), what to load into     evicted, copy in blocks to load; after it:
      which blocks, what to save, when a finished   write new blocks through, stage a finished
      request's blocks may be freed                 prompt for a decode instance

The two halves talk only through the step's KVConnectorMetadata (SchedulerOutput) and
KVConnectorOutput (ModelRunnerOutput). Blocks move whole, named by the prefix cache's block hash
chain, so the device prefix cache and every external tier agree on what a block holds.

Connectors (config.py): `cpu_offload` (host memory under the device pool), `redis` (a store any
instance can read), `multi` (both: device -> host -> Redis) and `p2p` (a prefill instance hands a
prompt's KV to a decode instance over authenticated ZMQ/TCP).
"""
