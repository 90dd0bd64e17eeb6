"""The prefix cache is per tenant: a row's `cached_tokens` never tells one tenant that another sent
the same prefix (a side channel), unless the deployment shares the cache on purpose."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bulkinfer.engine import EngineConfig, LLMEngine
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.hosts.engine_host import EngineHost
from bulkinfer.worker.hosts.model_hosts import HostedModel
from bulkinfer.worker.hosts.prefix_cache_salt import prefix_cache_salt
from bulkinfer.worker.hosts.prompt_renderer import PromptRenderer
from bulkinfer.worker.hosts.row_window import run_rows
from tests.worker.conftest import ENGINE_OPTIONS, Pipeline

# Several full 16-token blocks, so a prefix hit shows in cached_tokens.
PROMPT = "Summarise the quarterly revenue report for the board, listing every region in order: " * 2


def _cached_tokens(pipeline: Pipeline, tenant: str, name: str) -> list[int]:
    spec = JobSpec(input_uri=pipeline.put_input(f"{name}.jsonl", [json.dumps({"q": PROMPT})]), model="tiny",
                   prompt_column="q", sampling={"temperature": 0.0, "max_tokens": 2}, tenant=tenant)
    job_id = pipeline.submit(spec)
    status = pipeline.wait_for_end(job_id)
    assert status.state == JobState.SUCCEEDED, status.error
    return [record["usage"]["cached_tokens"] for record in pipeline.output_records(job_id)]


def test_a_tenant_hits_only_its_own_prefix_cache_on_a_shared_worker(pipeline: Pipeline) -> None:
    assert _cached_tokens(pipeline, "acme", "acme-first") == [0]
    # Another tenant, the same prompt, the same engine right after: nothing cached for it.
    assert _cached_tokens(pipeline, "globex", "globex-first") == [0]
    # The first tenant's next job does hit its own blocks.
    assert _cached_tokens(pipeline, "acme", "acme-second")[0] >= 16


@pytest.fixture(scope="module")
def hosted(tiny_checkpoint: Path) -> Iterator[HostedModel]:
    host = EngineHost(lambda: LLMEngine(EngineConfig(model=str(tiny_checkpoint), **ENGINE_OPTIONS)),
                      name="salted").start()
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(tiny_checkpoint)))
    yield HostedModel("tiny", tiny_checkpoint, host, renderer)
    host.stop()


def _run(hosted: HostedModel, prompt: str, tenant: str, share: bool) -> int:
    row = Row(index=0, row_id="r0", prompt=prompt, messages=None,
              sampling=JobSampling(temperature=0.0, max_tokens=1), response_format=None)
    [output] = run_rows(hosted, [row], cache_salt=prefix_cache_salt(tenant, share))
    assert output.error_code is None and output.cached_tokens is not None
    return output.cached_tokens


@pytest.mark.parametrize("share", [False, True])
def test_sharing_the_prefix_cache_across_tenants_is_the_deployments_choice(hosted: HostedModel,
                                                                           share: bool) -> None:
    prompt = f"{PROMPT} (shared: {share})"
    assert _run(hosted, prompt, "acme", share) == 0
    other_tenant = _run(hosted, prompt, "globex", share)
    assert (other_tenant >= 16) if share else (other_tenant == 0)
    assert _run(hosted, prompt, "acme", share) >= 16
