"""``make demo``: a preemption storm on the local platform, remediated, with a timeline.

- ``run``: the demo driver (``python -m kvpilot.operator.demo.run``).
- ``prepare``: the set-up: a model, a calibration probe, and an InferenceService with a KV pool too small.
- ``report``: the timeline's phases, summary and plot.
"""
