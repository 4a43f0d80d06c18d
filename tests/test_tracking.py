"""tracking.py's backends write what a person opens: TensorBoard's event file and wandb's offline run folder.

    python -m pytest tests/test_tracking.py -q
"""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tracking import Tracking


def test_tensorboard_and_offline_wandb_hold_every_steps_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: offline, never a login prompt
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(("console", "tensorboard", "wandb"), str(tmp_path), "nanoverl-test", "run", {"lr": 1e-3})
    for step in (1, 2, 3):
        tracker.log({"step": step, "critic/score/mean": 0.25 * step, "val/accuracy": 0.5, "note": "skipped"}, step)
    tracker.close()
    assert "step 3: reward=0.75 acc=0.5" in capsys.readouterr().out

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "note" not in events.Tags()["scalars"]

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    # the offline run's record log (what `wandb sync` uploads) holds each step's history row: the key and its
    # JSON value appear as they are (wandb 0.31 ships no reader for the file)
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert data.count(b"critic/score/mean") >= 3
    for value in (b"0.25", b"0.5", b"0.75"):
        assert value in data
    assert b"skipped" not in data  # not a number: not logged
