"""The OpenAI-compatible HTTP server (``kvpilot serve``).

``cli`` parses the flags (generated from ``EngineArgs``) and ``launch`` starts uvicorn; ``app`` builds
the FastAPI application over an ``AsyncEngine``; ``protocol`` validates request bodies; ``completions``
and ``chat`` turn engine outputs into OpenAI responses over what ``serving`` (state, checks, submission)
and ``streaming`` (Server-Sent Events) share; ``errors`` gives every failure OpenAI's error shape and
maps the engine's typed errors to status codes.
"""
