"""Rows with images through a hosted engine as a shard runs them (EngineRun): OpenAI chat lines with
`data:` URLs and file paths give the tokens the engine gives the same pictures directly; a corrupt,
missing or over-limit image is that row's `invalid_image` error while the others run; identical
pictures are deduplicated and different ones never are; a text-only model refuses image rows by row."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import pytest

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.llm_engine import LLMEngine
from bulkinfer.engine.qwen_vl_checkpoint import cached_qwen_vl_checkpoint
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint
from bulkinfer.jobs.formats.lines import Line
from bulkinfer.jobs.formats.openai_batch import OpenAIBatchRowBuilder
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.hosts.engine_rows import EngineRun
from bulkinfer.worker.hosts.model_hosts import HostedModel, ModelHosts
from bulkinfer.worker.images.fetcher import ImageFetcher
from bulkinfer.worker.images.stores import StoreOpener
from tests.support.hosted import ready
from tests.support.vision_reference import chat_text, picture, qwen_chat_text

pytestmark = pytest.mark.timeout(600)
OPTIONS = {"dtype": "float32", "max_model_len": 1024}
PICTURES = [picture(0, 50, 90), picture(1, 30, 30)]


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def hosts(tiny_checkpoint) -> Iterator[ModelHosts]:
    registry = ModelRegistry({"vlm": str(cached_vision_checkpoint("tiny")), "text": str(tiny_checkpoint),
                              "qwen": str(cached_qwen_vl_checkpoint())})
    hosts = ModelHosts(registry, OPTIONS)
    yield hosts
    hosts.stop()


def rows(model: str, contents: list) -> list:
    builder = OpenAIBatchRowBuilder(JobSpec(model=model, input_uri="s3://b/in.jsonl"))
    return [builder.build(Line(number, number + 1, b""), {
        "custom_id": f"r{number}", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6}})
        for number, content in enumerate(contents)]


def image_and_question(url: str, question: str = "What is this?") -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]


def run(hosted: HostedModel, items: list, deduplicate: bool = False,
        limits: ImageLimits | None = None) -> list:
    with ImageFetcher(StoreOpener(), limits) as images:
        engine_run = EngineRun(hosted, items, deduplicate=deduplicate, images=images)
        engine_run.wait(300)
        return engine_run.outputs()


def direct_text(question: str, image, model: str | None = None, chat=chat_text) -> str:
    model = model or str(cached_vision_checkpoint("tiny"))
    llm = LLMEngine(EngineConfig(model=model, **OPTIONS, num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=6)
    llm.add_request("x", chat(model, question), params, images=[image])
    while True:
        for output in llm.step():
            if output.finished:
                return output.outputs[0].text


def test_image_rows_run_and_bad_images_fail_alone(hosts, tmp_path):
    hosted = ready(hosts, "vlm")
    path = tmp_path / "square.png"
    PICTURES[1].save(path)
    out = run(hosted, rows("vlm", [
        image_and_question(png_data_url(PICTURES[0])),
        image_and_question(str(path)),
        image_and_question("data:image/png;base64," + base64.b64encode(b"not a png").decode()),
        image_and_question(str(tmp_path / "missing.png")),
        "Plain text, no picture.",
    ]))
    by_id = {row.row_id: row for row in out}
    assert not by_id["r0"].failed and by_id["r0"].text == direct_text("What is this?", PICTURES[0])
    assert not by_id["r1"].failed and by_id["r1"].text == direct_text("What is this?", PICTURES[1])
    assert by_id["r0"].prompt_tokens > 40  # the image's span is counted in usage
    for bad in ("r2", "r3"):
        assert by_id[bad].failed and by_id[bad].error_code == "invalid_image", by_id[bad]
        assert "messages[0].content[0]" in by_id[bad].error_message
    assert not by_id["r4"].failed


def test_identical_pictures_are_deduplicated_different_ones_never(hosts):
    hosted = ready(hosts, "vlm")
    out = run(hosted, rows("vlm", [image_and_question(png_data_url(PICTURES[0])),
                                   image_and_question(png_data_url(PICTURES[0])),
                                   image_and_question(png_data_url(PICTURES[1]))]), deduplicate=True)
    assert [row.deduplicated for row in out] == [False, True, False]
    assert out[0].text == out[1].text


def test_limits_and_text_only_models_are_row_errors(hosts):
    vlm = ready(hosts, "vlm")
    [over] = run(vlm, rows("vlm", [image_and_question(png_data_url(PICTURES[0]))]),
                 limits=ImageLimits(max_pixels=1000))
    assert over.error_code == "invalid_image" and "pixels" in over.error_message
    text = ready(hosts, "text")
    [refused] = run(text, rows("text", [image_and_question(png_data_url(PICTURES[0]))]))
    assert refused.error_code == "invalid_image" and "takes no images" in refused.error_message


def test_qwen2_5_vl_rows_run_as_the_engine_runs_them(hosts):
    qwen = ready(hosts, "qwen")
    [row] = run(qwen, rows("qwen", [image_and_question(png_data_url(PICTURES[0]))]))
    assert not row.failed, row
    model = str(cached_qwen_vl_checkpoint())
    assert row.text == direct_text("What is this?", PICTURES[0], model, qwen_chat_text)
