"""Reading TensorBoard event files record by record, independently of the compare tool."""

import glob
from pathlib import Path


def raw_scalars(run_dir: Path, tag: str) -> dict:
    """{step: value} of a scalar, read record by record (TensorBoard's legacy loader keeps the raw
    ``simple_value``): independent of the EventAccumulator the compare tool uses."""
    from tensorboard.backend.event_processing.event_file_loader import (
        LegacyEventFileLoader,
    )

    out = {}
    for path in sorted(glob.glob(str(run_dir / "events.out.tfevents.*"))):
        for event in LegacyEventFileLoader(path).Load():
            for v in event.summary.value:
                if v.tag == tag and v.WhichOneof("value") == "simple_value":
                    out[int(event.step)] = float(v.simple_value)
    return out
