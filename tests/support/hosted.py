"""A model of a test's `ModelHosts`, loaded and ready."""

from __future__ import annotations

from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts


def ready(hosts: ModelHosts, name: str, timeout_s: float = 120) -> HostedModel:
    hosted = hosts.get(name)
    hosted.host.wait_ready(timeout_s)
    return hosted
