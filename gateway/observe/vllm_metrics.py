"""The LLM engine's metrics also under vLLM's own names, for vLLM dashboards and KEDA scalers.

The engine records `fleetgate_llm_<name>{deployment=...}` (backends/torch_llm/metrics.py). At each
scrape, every such family is repeated as `vllm:<name>{model_name=...}` with the same samples, the
`deployment` label renamed `model_name` (a deployment is one engine, as a vLLM server is), and
`kv_cache_usage_perc` also as `vllm:gpu_cache_usage_perc` (the older name dashboards still chart).
Nothing is recorded twice: the copies are made from the scraped families.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

PREFIX = "fleetgate_llm_"
#: vLLM names that a fleetgate family is exported under (besides `vllm:<same name>`)
EXTRA_NAMES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",)}
#: fleetgate's own additions, with no vLLM counterpart
OWN = {"kv_cache_waste_perc"}


def _renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {("model_name" if k == "deployment" else k): v for k, v in sample.labels.items()}
        suffix = sample.name[len(family.name) :]
        copy.samples.append(Sample(name + suffix, labels, sample.value, sample.timestamp, sample.exemplar))
    return copy


def vllm_families(families: Iterable[Metric]) -> Iterator[Metric]:
    """The vLLM-named copies of the engine's families among `families`."""
    for family in families:
        if not family.name.startswith(PREFIX):
            continue
        short = family.name[len(PREFIX) :]
        if short in OWN:
            continue
        for name in (short, *EXTRA_NAMES.get(short, ())):
            yield _renamed(family, f"vllm:{name}")


class VllmNames(Collector):
    """A collector over another registry's families: their vLLM-named copies (for generate_latest)."""

    def __init__(self, source: Collector) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return vllm_families(self._source.collect())
