"""One Worker per device: owns the device, the process groups and one ModelRunner."""
from worker.worker import Worker

__all__ = ["Worker"]
