"""The engine metrics of cluster/entrypoints/openai/metrics.py exported through Ray's metrics agent (ray.util.metrics),
so that a Prometheus scraping Ray's nodes sees every Serve replica, not only the one that answered a /metrics request.
Ray takes no ':' in names and prefixes its own: `vllm:num_requests_running` is exported as
`ray_vllm_num_requests_running`, counters with `_total`, as vLLM's RayPrometheusStatLogger does."""
from __future__ import annotations

from typing import Any

from ray.util import metrics

from raylm.cluster.entrypoints.openai.metrics import PrometheusStatLogger


def ray_metric_name(name: str) -> str:
    return name.replace(":", "_")


class _LabelledRayMetric:
    """prometheus_client's `metric.labels(**labels).set / inc / observe` over one ray.util.metrics metric."""

    def __init__(self, metric: metrics.Metric, labels: dict[str, str] | None = None) -> None:
        self.metric, self.tags = metric, labels

    def labels(self, **labels: str) -> _LabelledRayMetric:
        return _LabelledRayMetric(self.metric, labels)

    # Ray annotates `tags: Dict[str, str] = None` (an implicit Optional): None means the metric's default tags.
    def set(self, value: float) -> None:
        assert isinstance(self.metric, metrics.Gauge)
        self.metric.set(value, tags=self.tags)  # type: ignore[arg-type]

    def inc(self, value: float = 1.0) -> None:
        assert isinstance(self.metric, metrics.Counter)
        if value > 0:  # Ray's counters refuse 0; a series appears with its first increment
            self.metric.inc(value, tags=self.tags)  # type: ignore[arg-type]

    def observe(self, value: float) -> None:
        assert isinstance(self.metric, metrics.Histogram)
        self.metric.observe(value, tags=self.tags)  # type: ignore[arg-type]


class RayPrometheusStatLogger(PrometheusStatLogger):
    """The same metrics, labels and updates as PrometheusStatLogger, recorded in Ray's metrics instead of this app's
    registry (whose exposition stays empty)."""

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Any:
        return _LabelledRayMetric(metrics.Gauge(ray_metric_name(name), doc, tuple(labels)))

    def _counter(self, name: str, doc: str, labels: list[str]) -> Any:
        return _LabelledRayMetric(metrics.Counter(ray_metric_name(name), doc, tuple(labels)))

    def _histogram(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Any:
        return _LabelledRayMetric(metrics.Histogram(ray_metric_name(name), doc, list(buckets), tuple(labels)))
