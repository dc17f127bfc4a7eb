"""The scoring front door: pick a ready engine replica per request by queue depth, KV usage and
prefix-cache affinity, in the spirit of llm-d's endpoint picker (the Gateway API Inference Extension's
EPP); ``kvpilot router`` serves it in a cluster and the local platform's front door reuses it.

- ``prefix``: the prompt of a request as one canonical string, its chained block hashes, and the
  bounded LRU index block hash -> replicas that served it (pure).
- ``scoring``: the pure scorer, one pick from the candidates' loads and prefix matches.
- ``scrape``: the background reader of each replica's ``/metrics`` (aiohttp).
- ``proxy``: the balancing proxy (aiohttp): in-flight counts, the policy, retries, streaming relay.
- ``discovery``: backends from the A/AAAA records of a headless Service, refreshed.
- ``cli``: ``kvpilot router`` and its own ``/metrics`` (``kvpilot_router_*``).
"""
