"""What the API tells about the deployment: /metrics (jobs by status, queue lengths, live workers),
/workers (heartbeats), a job's /progress (rows over time, errors by code) and the /ui shell."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.results import PartFile, ShardResult, TokenUsage, save_shard_result
from bulkinfer.jobs.workers import WorkerBeat, WorkerModel, write_beat
from tests.api.conftest import MODELS, serve


def sample(text: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def submit(api, name: str = "rows.jsonl") -> str:  # noqa: ANN001
    uri = api.put_input(name, b'{"q": "def f(x):"}\n')
    return api.client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q"}).job_id


def test_metrics_count_jobs_by_status_and_the_tasks_waiting_in_each_queue(local_api) -> None:
    submit(local_api, "a.jsonl")
    submit(local_api, "b.jsonl")
    text = httpx.get(f"{local_api.url}/metrics").text
    assert sample(text, 'bulkinfer_jobs{status="queued"}') == 2
    assert sample(text, 'bulkinfer_jobs{status="succeeded"}') == 0
    # No worker runs here: both plan tasks wait on the control queue; the model queues are empty.
    assert sample(text, 'bulkinfer_queue_length{queue="bulkinfer.control"}') == 2
    assert sample(text, 'bulkinfer_queue_length{queue="bulkinfer.model.tiny"}') == 0
    assert sample(text, 'bulkinfer_workers{model="tiny"}') == 0
    assert "# TYPE bulkinfer_jobs gauge" in text


def test_workers_lists_live_heartbeats_and_metrics_count_them_per_model(local_api) -> None:
    now = datetime.now(UTC)
    beat = WorkerBeat(hostname="gpu-7@node-a", pid=42, started_at=now, updated_at=now,
                      models=[WorkerModel(name="tiny", state="loaded", dtype="bfloat16", device="cuda",
                                          running=12, waiting=3, tokens_per_s=812.5)])
    write_beat(local_api.redis, local_api.repository.namespace, beat)
    listed = httpx.get(f"{local_api.url}/workers").json()["workers"]
    assert [(w["hostname"], w["models"][0]["dtype"], w["models"][0]["tokens_per_s"]) for w in listed] == [
        ("gpu-7@node-a", "bfloat16", 812.5)]
    text = httpx.get(f"{local_api.url}/metrics").text
    assert sample(text, 'bulkinfer_workers{model="tiny"}') == 1


def test_a_jobs_progress_adds_up_its_finished_shards_over_time(local_api) -> None:
    job_id = submit(local_api)
    layout = local_api.repository.layout(job_id)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    part = PartFile(key="k", uri="file:///k", rows=0, bytes=0, sha256="0" * 64)
    for index, (rows, failed, codes) in enumerate([(10, 1, {"row_too_long": 1}), (10, 2, {"row_too_long": 1,
                                                                                           "bad_json": 1})]):
        save_shard_result(local_api.store, layout, ShardResult(
            shard_index=index, planned_rows=rows, rows_succeeded=rows - failed, rows_failed=failed,
            usage=TokenUsage(prompt=100, completion=50), output=part, errors=part, started_at=start,
            finished_at=start + timedelta(seconds=10 * (index + 1)), error_codes=codes))
    progress = httpx.get(f"{local_api.url}/jobs/{job_id}/progress").json()
    points = [(point["rows"], point["completion_tokens"]) for point in progress["points"]]
    assert points == [(10, 50), (20, 100)]
    assert progress["errors_by_code"] == {"bad_json": 1, "row_too_long": 2}
    assert progress["rows_per_s"] == pytest.approx(1.0)  # 20 rows from the first start to the last finish


def test_the_status_page_is_served_without_a_key_and_holds_no_data(redis_url, tmp_path) -> None:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys="acme=acme-secret", admin_api_keys="root-secret")
    with serve(settings) as api:
        page = httpx.get(f"{api.url}/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<title>bulkinfer status</title>" in page.text
        # Its data needs a key: the tenant's for jobs, an admin's for the metrics of every tenant.
        assert httpx.get(f"{api.url}/workers").status_code == 401
        tenant = {"Authorization": "Bearer acme-secret"}
        assert httpx.get(f"{api.url}/workers", headers=tenant).status_code == 200
        refused = httpx.get(f"{api.url}/metrics", headers=tenant)
        assert refused.status_code == 403 and "admin key" in refused.json()["detail"]
        admin = httpx.get(f"{api.url}/metrics", headers={"Authorization": "Bearer root-secret"})
        assert admin.status_code == 200 and "bulkinfer_jobs" in admin.text


def test_a_tenant_sees_workers_models_but_not_their_hosts_or_pids(redis_url, tmp_path) -> None:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys="acme=acme-secret", admin_api_keys="root-secret")
    now = datetime.now(UTC)
    with serve(settings) as api:
        for host, pid in (("gpu-7@node-a", 42), ("gpu-8@node-b", 43)):
            write_beat(api.redis, api.repository.namespace, WorkerBeat(
                hostname=host, pid=pid, started_at=now, updated_at=now,
                models=[WorkerModel(name="tiny", state="loaded", running=2, tokens_per_s=10.0)]))

        def listed(key: str) -> list[dict]:
            answer = httpx.get(f"{api.url}/workers", headers={"Authorization": f"Bearer {key}"})
            return answer.json()["workers"]
        seen = listed("acme-secret")
        assert [(w["hostname"], w["pid"], w["models"][0]["name"]) for w in seen] == [
            ("worker-1", None, "tiny"), ("worker-2", None, "tiny")]
        assert "node-a" not in json.dumps(seen) and "42" not in json.dumps([w["pid"] for w in seen])
        assert [(w["hostname"], w["pid"]) for w in listed("root-secret")] == [("gpu-7@node-a", 42),
                                                                              ("gpu-8@node-b", 43)]


def test_a_model_whose_architecture_the_workers_cannot_load_is_refused_at_submit(local_api, tmp_path) -> None:
    """The workers' load error (the engine's, naming the architectures it serves) comes back at POST
    /jobs instead of failing the job later; a failure of another kind, or a worker that loaded the
    model, does not refuse it."""
    from bulkinfer.api.client import ApiError
    from bulkinfer.engine.models import UnsupportedModelError, model_config_from_dir

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as load_error:
        model_config_from_dir(tmp_path)
    now = datetime.now(UTC)

    def beat(host: str, state: str) -> None:
        models = [WorkerModel(name="tiny", state=state)]
        write_beat(local_api.redis, local_api.repository.namespace,
                   WorkerBeat(hostname=host, pid=1, started_at=now, updated_at=now, models=models))

    beat("a", f"failed: {load_error.value}")
    with pytest.raises(ApiError) as refused:
        submit(local_api, "refused.jsonl")
    assert refused.value.status_code == 400
    message = refused.value.message
    assert "model 'tiny' cannot run here: unsupported architecture ['GPT2LMHeadModel']" in message
    assert "MixtralForCausalLM" in refused.value.message and "Qwen3MoeForCausalLM" in refused.value.message
    beat("a", "failed: CUDA out of memory")  # not the checkpoint's fault: the job may still run
    assert submit(local_api, "oom.jsonl")
    beat("a", f"failed: {load_error.value}")
    beat("b", "loaded")  # another worker serves it (another copy of the folder)
    assert submit(local_api, "served.jsonl")


def test_a_quantized_checkpoint_the_workers_cannot_load_is_refused_at_submit_by_its_scheme(
        local_api, tmp_path) -> None:
    from bulkinfer.api.client import ApiError
    from bulkinfer.engine.models import UnsupportedModelError, model_config_from_dir

    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "quantization_config": quant}))
    with pytest.raises(UnsupportedModelError) as load_error:
        model_config_from_dir(tmp_path)
    now = datetime.now(UTC)
    write_beat(local_api.redis, local_api.repository.namespace, WorkerBeat(
        hostname="a", pid=1, started_at=now, updated_at=now,
        models=[WorkerModel(name="tiny", state=f"failed: {load_error.value}")]))
    with pytest.raises(ApiError) as refused:
        submit(local_api, "quantized.jsonl")
    assert refused.value.status_code == 400
    assert "model 'tiny' cannot run here:" in refused.value.message
    assert "is a quantized checkpoint (gptq 4-bit is not a scheme bulkinfer runs" in refused.value.message
