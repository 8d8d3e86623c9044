"""One Worker per device: owns the device, the process groups and one ModelRunner."""
from raylm.worker.worker import Worker

__all__ = ["Worker"]
