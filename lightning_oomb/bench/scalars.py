"""The TensorBoard scalars a run logged, read back: one reader for the bench reports and the GPU scripts."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class Scalar(NamedTuple):
    """One logged value: the step it was logged at, its value, its wall time (seconds since the epoch)."""

    step: int
    value: float
    wall_time: float


def read_scalars(folder: Path | str) -> dict[str, list[Scalar]]:
    """{tag: points} of every scalar logged under ``folder`` (a run's version folder or any folder above it:
    event files are read however deep), each tag's points in wall-time order across the files (a resumed run
    writes a second file into the same folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, list[Scalar]] = {}
    for events_file in sorted(Path(folder).rglob("events.out.tfevents.*")):
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in events.Tags()["scalars"]:
            tags.setdefault(tag, []).extend(Scalar(e.step, e.value, e.wall_time) for e in events.Scalars(tag))
    for points in tags.values():
        points.sort(key=lambda p: (p.wall_time, p.step))
    return tags
