"""The operator's own Prometheus metrics (``kvpilot_operator_*``) and their HTTP exposition."""

from kvpilot.operator.observability.metrics import OperatorMetrics, classify_decision
from kvpilot.operator.observability.server import MetricsServer

__all__ = ["MetricsServer", "OperatorMetrics", "classify_decision"]
