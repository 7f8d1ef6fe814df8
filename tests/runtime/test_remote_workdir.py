"""A `gs://` workdir holds every file of a run (on the GCS emulator): metrics, TensorBoard events, tokenizer,
curriculum, transcripts, summary, plot, log and checkpoints, with nothing written locally; a second invocation
resumes from the bucket with the same curriculum."""

import json
import logging
import uuid

import pytest
from etils import epath

from mgrpo_jax.rl.run import log_to_file, outputs
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.runtime import files
from mgrpo_jax.runtime.metrics import read_jsonl
from tests.rl.test_trainer import _smoke
from tests.store import conftest as store_conftest


@pytest.fixture(scope="module")
def gcs_emulator():
    with store_conftest.shared_emulator() as url:
        yield url


def _stage2(steps: int):
    config = _smoke(steps=steps)
    config.stage, config.warmstart.steps, config.train.eval_every = "stage2", 1, 0
    config.env.stage2_filter_pool, config.env.stage2_filter_samples = 6, 1
    config.env.stage2_max_success = 1.0 - 1e-9  # a filtered curriculum, written to curriculum.json
    config.train.log_transcripts = 1
    return config


def test_append_file_and_atomic_writes_on_the_bucket(gcs_emulator):
    folder = epath.Path(f"gs://{store_conftest.BUCKET}/{uuid.uuid4().hex[:8]}")
    with files.AppendFile(folder / "log.jsonl") as f:
        f.write("a\n")
        f.write("b\n")
    files.append_text(folder / "log.jsonl", "c\n")  # a later writer continues the object
    assert (folder / "log.jsonl").read_text() == "a\nb\nc\n"
    files.write_atomic(folder / "x.json", "{}")
    files.write_atomic(folder / "x.json", '{"a": 1}')
    assert files.read_text(folder / "x.json") == '{"a": 1}' and files.read_text(folder / "missing") is None


@pytest.mark.slow
def test_a_gs_workdir_holds_every_file_and_resumes_from_the_bucket(gcs_emulator, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything written locally would land here (or in a folder named "gs:")
    workdir = f"gs://{store_conftest.BUCKET}/{uuid.uuid4().hex[:8]}/run"
    package_logger = logging.getLogger("mgrpo_jax")
    level = package_logger.level
    package_logger.setLevel(logging.INFO)  # setLevel, not setattr: it clears the loggers' isEnabledFor caches
    log_path = log_to_file(workdir)
    handler = logging.getLogger().handlers[-1]
    try:
        first = Trainer(_stage2(steps=1), workdir)
        first.run()
        first.writer.close()
        handler.flush()
        bucket = epath.Path(workdir)
        names = {p.name for p in bucket.iterdir()}
        assert {"metrics.jsonl", "tb", "tokenizer.model", "curriculum.json", "transcripts.jsonl", "summary.json",
                "rewards.png", "run.log", "checkpoints"} <= names, names
        assert log_path == str(bucket / "run.log") and "step 1/1 |" in (bucket / "run.log").read_text()
        assert list((bucket / "tb").iterdir()) and (bucket / "rewards.png").read_bytes()[:4] == b"\x89PNG"
        assert json.loads((bucket / "summary.json").read_text())["run"]["status"] == "finished"
        assert [label for label, _ in outputs(workdir)][:5] == ["metrics", "tensorboard", "plot", "checkpoints",
                                                               "summary"]
        curriculum = (bucket / "curriculum.json").read_text()

        resumed = Trainer(_stage2(steps=2), workdir)  # another invocation: restores from the bucket
        assert [q.id for q in resumed.feed.questions] == json.loads(curriculum)["kept"]
        resumed.run()
        resumed.writer.close()
        assert resumed.step == 2 and (bucket / "curriculum.json").read_text() == curriculum
        assert [r["step"] for r in read_jsonl(bucket / "metrics.jsonl") if "step" in r] == [1, 2]
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        package_logger.setLevel(level)
    assert list(tmp_path.iterdir()) == []  # nothing written locally
