"""Pure manifest builders: resolved settings in, child objects out.

- ``podspec``: the engine pod template (command, args, volumes, env, probes, security).
- ``builders``: the Deployment, Service, PDB, ServiceMonitor and Events of one InferenceService.
"""
