"""The Python SDK as a notebook uses it, and nothing else: `pylon.connect()`, then data preparation, training,
metrics, the loss plot, checkpoints and serving, all on the session's real Ray cluster."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

import pylon
from pylon.errors import PylonError

pytestmark = pytest.mark.integration
STDLIB = Path(sysconfig.get_paths()["stdlib"])
KEYS_ENV = "PYLON_SDK_TEST_KEYS"
API_KEY = "sk-pylon-sdk-test-5e1d"


def _train_spec(name: str, corpus: str, runs: str, **over) -> dict:
    # The shape of tests/integration/test_train.py's runs, on one worker, for speed.
    return {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "data": {"uri": corpus, "seq_len": 64, "shuffle_seed": 1, "shuffle_buffer": 64},
        "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "batch": {"micro_batch_size": 4},
        "steps": 12,
        "checkpoint": {"storage": runs, "every_steps": 4, "keep_last": 2},
        **over,
    }


# Each step also has its own tests (test_prepare_s3_ray, test_train, test_serving; tests/unit/sdk/test_sdk.py for the
# SDK); this is the whole notebook flow at once, ~110 s. `make test-all`.
@pytest.mark.slow
def test_a_notebook_prepares_trains_plots_serves_and_cleans_up(ray_cluster, tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    client = pylon.connect()

    # Data: a few standard-library modules, tokenized by a `pylon data prepare` Ray job.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py"):
        shutil.copy(STDLIB / name, src / name)
    data = client.prepare_data(sources=[src], output=tmp_path / "corpus", seq_len=64)
    assert data.name == "corpus" and data.job_id.startswith("data-corpus-")
    assert data.wait(timeout=300) == "SUCCEEDED", data.logs()
    manifest = data.manifest()
    assert manifest.seq_len == 64 and manifest.totals.rows > 100 and manifest.totals.documents == 4

    # Training, from a dict (written to $PYLON_HOME/specs/ and submitted as `pylon train` would).
    run = client.train(_train_spec("sdk-tiny", data.output, str(tmp_path / "runs")))
    assert run.job_id.startswith("train-sdk-tiny-") and run.run_uri == str(tmp_path / "runs" / "sdk-tiny")
    assert Path(ray_cluster.home, "specs", f"{run.job_id}.yaml").is_file()  # what was submitted
    assert run.logs(follow=True) is None  # streamed to stdout until the job ended
    streamed = capsys.readouterr().out
    assert "model: " in streamed and '{"result": ' in streamed  # from the first lines to the job's last
    assert run.wait() == "SUCCEEDED" and run.status() == "SUCCEEDED"

    metrics = run.metrics()
    assert list(metrics["step"]) == list(range(1, 13))
    assert {"loss", "lr", "tokens_per_s", "mfu", "data_wait_fraction"} <= set(metrics.columns)
    assert metrics["loss"].iloc[-3:].mean() < metrics["loss"].iloc[0], "it did not learn"
    fig = run.plot()
    assert isinstance(fig, matplotlib.figure.Figure)
    assert list(fig.axes[0].lines[0].get_ydata()) == list(metrics["loss"])
    assert run.checkpoints() == [8, 12]
    assert any(r.job_id == run.job_id and r.run_uri == run.run_uri and r.name == "sdk-tiny" for r in client.runs())
    for text in (repr(run), run._repr_html_()):
        assert "sdk-tiny" in text and "SUCCEEDED" in text and run.job_id in text

    # Serving the run's export, behind an API key read from the environment at deploy time.
    monkeypatch.setenv(KEYS_ENV, API_KEY)
    service = client.deploy(
        {
            "kind": "Deployment",
            "name": "sdk-tiny",
            "model": run.run_uri + "/export",
            "engine": {
                "max_num_seqs": 4,
                "max_num_batched_tokens": 256,
                "kv_cache_tokens": 1024,
                "max_model_len": 128,
                "device": "cpu",
            },
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "http": {"api_keys_env": KEYS_ENV, "route_prefix": "/sdk"},
            "replica": {"num_cpus": 0.5},
        }
    )
    monkeypatch.delenv(KEYS_ENV)  # the Service keeps the key it read
    try:
        assert service.url.endswith("/sdk")
        text = service.complete("def ", max_tokens=24, temperature=0, ignore_eos=True)
        assert isinstance(text, str) and text
        chunks = list(service.complete("def ", max_tokens=24, temperature=0, ignore_eos=True, stream=True))
        assert len(chunks) > 1 and "".join(chunks) == text
        assert service.complete("def ", max_tokens=24, temperature=0, ignore_eos=True, n=2) == [text, text]
        with pytest.raises(PylonError, match="n=2 leave stream off"):
            service.complete("def ", n=2, stream=True)
        reply = service.chat([{"role": "user", "content": "def"}], max_tokens=8, temperature=0, ignore_eos=True)
        assert reply == "".join(service.chat("def", max_tokens=8, temperature=0, ignore_eos=True, stream=True))
        one, both = service.embed("def "), service.embed(["def ", "class "])
        assert len(both) == 2 and both[0] == pytest.approx(one, abs=1e-6) and both[1] != both[0]
        assert sum(v * v for v in one) == pytest.approx(1.0, abs=1e-4)  # L2-normalised
        assert len(service.embed("def ", dimensions=8)) == 8
        assert service.status() == "RUNNING" and service.replicas() == 1
        listed = {s.name: s for s in client.services()}
        assert listed["sdk-tiny"].url == service.url
        with pytest.raises(PylonError, match="HTTP 401"):
            client.service("sdk-tiny", api_key="sk-wrong").complete("def ")
        for shown in (repr(service), service._repr_html_()):
            assert "sdk-tiny" in shown and "RUNNING" in shown and API_KEY not in shown
    finally:
        service.delete()
    assert service.status() == "NOT_FOUND"
    assert "sdk-tiny" not in [s.name for s in client.services()]
