"""kvpilot's Kubernetes operator: the InferenceService resource reconciled into engine pods.

Layout (only ``kube``, ``reconcile``, ``scrape``, ``autotuner``, ``handlers`` and ``cli`` do I/O;
``replay`` reads its input files):

- ``names``: API group, labels, annotations and ports shared by every module.
- ``spec``: reading an InferenceService spec: defaults, model sources, quantities, durations.
- ``validation``: checks beyond the CRD schema; returns every problem at once.
- ``effective``: ``effective = spec ⊕ status.effective.overrides`` (the remediation seam).
- ``podspec`` / ``builders``: pure manifest builders for the children.
- ``status``: pure status and condition computation, and the minimal status patch.
- ``window``: engine metrics parsed, per-pod series (counter resets), the window the policy reads.
- ``policy``: ``decide(window, spec, effective, history, now) -> Decision``, the remediation policy.
- ``pods``: which engine pods to scrape, which fail, which run an outdated configuration.
- ``remediation``: one evaluation: the decision, the status patch it writes and its Events.
- ``replay``: recorded scrapes through the same evaluation, offline (``kvpilot replay``).
- ``kube``: a small asyncio Kubernetes client over kopf's connection info.
- ``reconcile``: one reconcile pass (read, build, apply what changed, write status).
- ``scrape``: concurrent ``/metrics`` scrapes with short timeouts; the JSON Lines recorder.
- ``autotuner``: the remediation loop (list, scrape, evaluate, write status, re-render).
- ``handlers``: the kopf registry and settings (thin).
- ``cli``: ``kvpilot operator``, ``kvpilot render`` and ``kvpilot replay``.

Nothing here imports torch or transformers: the operator image is slim.
"""
