"""Real services the tests start themselves."""

from det_lab.tracking.mlflow_server import MlflowServer, free_port

__all__ = ["MlflowServer", "free_port"]
