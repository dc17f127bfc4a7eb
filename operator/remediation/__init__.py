"""Remediation: engine metrics in, capacity changes out. Pure except ``loop`` and ``scrape``.

- ``metrics``: one ``/metrics`` answer parsed into a ``Scrape``; KV capacity and model shape.
- ``series``: one pod's scrapes over time, resets folded in, and the one ingest the loop and replay share.
- ``window``: every ready pod's series reduced to the ``MetricWindow`` the policy reads.
- ``decision``: modes, lever names, the ``Decision`` and the ``Change`` history entries.
- ``signals``: what a window says (storm on counts, demand, idleness) and its one-line description.
- ``policy``: ``decide(window, settings, history, now)``, the pure policy.
- ``evaluate``: one evaluation's status patch and Events.
- ``pods``: which engine pods to scrape, which fail, which are outdated.
- ``replay``: recorded scrapes through the same path, offline (``kvpilot replay``).
- ``scrape``: concurrent HTTP scrapes and the recording of them (I/O).
- ``loop``: the remediation loop that lists, scrapes, evaluates and writes every interval (I/O).
"""
