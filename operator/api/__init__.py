"""The InferenceService API as the operator reads it; pure (no client, no HTTP).

- ``names``: the API group, labels, annotations, ports and paths every other module spells from here.
- ``spec``: the defaults table (the CRD's ``default:`` values); model sources, quantities, durations.
- ``validation``: the checks the CRD schema cannot express.
- ``effective``: spec ⊕ ``status.effective.overrides``, what the pods should run.
- ``platform``: the operator's own configuration every object is resolved with (default image, allowlists).
- ``settings``: ``resolve(isvc, platform)``, the one call that applies the defaults, validates and
  resolves the rest.
- ``conditions``: status conditions, shared by the reconciler and remediation.
- ``rest``: REST paths of objects, ``ApiError`` and the ``Kube`` protocol of the client.
- ``timefmt``: RFC 3339 timestamps and unix seconds.
- ``patch``: JSON merge patch (RFC 7386).
"""
