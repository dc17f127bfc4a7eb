"""``kvpilot plan``: predict what a knob change does before making it.

The engine's own torch-free ``Scheduler`` and ``BlockManager`` run on a simulated clock over the
workload a service has seen:

* ``simulate``: the simulator (arrivals in, per-run predictions out; no model, no torch);
* ``step_time``: how long one engine step takes, fitted from the engine's own histograms;
* ``recording``: the recorded scrapes (``kvpilot replay``'s JSON Lines) as counters, gauges and
  histograms, and the intervals between a pod's scrapes;
* ``workload``: arrival rate, prompt/output length distributions and the KV pool from a recording;
* ``candidates``: the settings in force and a grid within ``spec.remediation.limits``, each simulated;
* ``cli``: the ``kvpilot plan`` command (table, JSON).
"""
