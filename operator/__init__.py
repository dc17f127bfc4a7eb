"""kvpilot's Kubernetes operator: the InferenceService resource reconciled into engine pods.

Layout (pure modules first; only ``kube``, ``reconcile``, ``handlers`` and ``cli`` do I/O):

- ``names``: API group, labels, annotations and ports shared by every module.
- ``spec``: reading an InferenceService spec: defaults, model sources, quantities, durations.
- ``validation``: checks beyond the CRD schema; returns every problem at once.
- ``effective``: ``effective = spec ⊕ status.effective.overrides`` (the remediation seam).
- ``podspec`` / ``builders``: pure manifest builders for the children.
- ``status``: pure status and condition computation, and the minimal status patch.
- ``kube``: a small asyncio Kubernetes client over kopf's connection info.
- ``reconcile``: one reconcile pass (read, build, apply what changed, write status).
- ``handlers``: the kopf registry and settings (thin).
- ``cli``: ``kvpilot operator`` and ``kvpilot render``.

Nothing here imports torch or transformers: the operator image is slim.
"""
