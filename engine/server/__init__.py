"""The OpenAI-compatible HTTP server (``kvpilot serve``).

``cli`` parses the flags (generated from ``EngineArgs``) and starts uvicorn; ``app`` builds the FastAPI
application over an ``AsyncEngine``; ``protocol`` validates request bodies; ``completions`` and ``chat``
turn engine outputs into OpenAI responses and Server-Sent Events; ``errors`` gives every failure
OpenAI's error shape.
"""
