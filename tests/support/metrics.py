"""Reading a Prometheus text exposition in tests: samples by name and labels, and every
series name it exposes (what a PromQL query can name)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]

# The series a family of each type exposes, by suffix (prometheus_client's text format 0.0.4).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def samples(text: str) -> dict[Key, float]:
    """Every sample, keyed by its series name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def exposed_names(text: str) -> set[str]:
    """The series names a query can select: those with samples, and those a declared family
    without samples yet (a labelled metric nobody counted) will have."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names
