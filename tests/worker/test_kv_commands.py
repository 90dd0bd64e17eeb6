"""`bulkinfer kv ls|rm` over the store the settings name: what the workers saved, per model
namespace, and deleting it (a namespace, or everything), with a clear refusal of anything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkinfer.api.cli import main
from bulkinfer.engine.kv_connector.keys import namespace
from bulkinfer.engine.kv_connector.model_identity import model_identity
from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.worker.kv.blob_store import ObjectStoreBlobStore

FP32 = "kv/" + "1" * 32 + "/fp32/tp0of1/b16/"
BF16 = "kv/" + "1" * 32 + "/bf16/tp0of1/b16/"


@pytest.fixture
def store_dir(tmp_path):
    blobs = ObjectStoreBlobStore(LocalObjectStore(tmp_path))
    for n in range(3):
        blobs.put_if_absent(f"{FP32}{n:064x}", b"k" * 1000)
    blobs.put_if_absent(f"{BF16}{0:064x}", b"k" * 500)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.json").write_text("{}")  # a job's file: never listed nor deleted
    return tmp_path


def test_kv_ls_lists_each_namespace_with_its_blocks_and_bytes(store_dir, capsys) -> None:
    assert main(["kv", "ls", "--store-uri", str(store_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("kv/")}
    assert lines[FP32][:4] == ["-", "3", "2.9", "KiB"] and lines[BF16][:4] == ["-", "1", "500", "B"]
    assert "total: 4 blocks, 3.4 KiB" in out
    assert main(["kv", "ls", BF16, "--kv-store-uri", str(store_dir)]) == 0  # one namespace, by kv_store_uri
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("kv/")]
    assert listed == [BF16]


def test_kv_rm_deletes_a_namespace_or_everything_and_nothing_else(store_dir, capsys) -> None:
    assert main(["kv", "rm", BF16, "--store-uri", str(store_dir)]) == 0
    assert "deleted 1 blocks" in capsys.readouterr().out
    assert not (store_dir / BF16).exists() or not any((store_dir / BF16).iterdir())
    assert len(list((store_dir / FP32).iterdir())) == 3
    assert main(["kv", "rm", "--all", "--store-uri", str(store_dir)]) == 0
    assert "deleted 3 blocks" in capsys.readouterr().out
    assert (store_dir / "jobs" / "job.json").read_text() == "{}"
    assert main(["kv", "ls", "--store-uri", str(store_dir)]) == 0
    assert "no blocks stored" in capsys.readouterr().out


@pytest.mark.parametrize("prefix", ["jobs/", "", "kvx/"])
def test_kv_rm_refuses_a_prefix_outside_the_kv_folder(store_dir, capsys, prefix: str) -> None:
    assert main(["kv", "rm", prefix, "--store-uri", str(store_dir)]) == 2
    assert "is not a KV prefix: namespaces start with 'kv/'" in capsys.readouterr().err
    assert (store_dir / "jobs" / "job.json").exists() and len(list((store_dir / FP32).iterdir())) == 3


def test_kv_ls_names_the_served_model_of_a_namespace_whose_folder_is_here(store_dir, tiny_checkpoint: Path,
                                                                        capsys) -> None:
    tiny = namespace(model_identity(tiny_checkpoint), "bfloat16", 0, 1, 16)  # as its engines name it
    ObjectStoreBlobStore(LocalObjectStore(store_dir)).put_if_absent(f"{tiny}{1:064x}", b"k" * 10)
    models = json.dumps({"tiny": str(tiny_checkpoint)})
    assert main(["kv", "ls", "--store-uri", str(store_dir), "--models", models]) == 0
    lines = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("kv/")}
    assert lines == {tiny: "tiny", FP32: "-", BF16: "-"}  # the others: weights not served here
