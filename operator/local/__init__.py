"""The local platform (``kvpilot up --local``): the operator's reconciler and remediation loop on one machine.

- ``platform``: ``LocalPlatform`` and the ``kvpilot up`` command.
- ``api``: an in-memory Kubernetes API, the operator's client with a dict for transport.
- ``replicas``: the local kubelet, the rendered Deployment as ``kvpilot serve`` processes.
- ``process``: one replica process: args, environment, GPUs, signals.
- ``frontdoor``: one OpenAI-compatible port in front of the ready replicas.
"""
