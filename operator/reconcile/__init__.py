"""Reconciling an InferenceService's children and status, through an injected API client (no kopf, no HTTP).

- ``reconciler``: one reconcile pass, and the ``Reconciler`` that runs passes one at a time per object.
- ``status``: the phase, replica counts and conditions the reconciler owns, and the minimal patch to them.
"""
