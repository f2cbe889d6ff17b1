"""Where a run's results go: the MLflow tracker and its local copy (`tracker`), the worker that
logs to MLflow off the training thread (`worker`), the store's operations (`ops`, `store`) and
P4L's participation curves (`participation`).

`p4bench.tracking` was one module until 0.2; its names still resolve here, with a deprecation
warning naming `p4bench.tracking.tracker`, for one minor version.
"""

from __future__ import annotations

from p4bench.moved import forward_moved

__getattr__ = forward_moved(
    __name__,
    {
        **dict.fromkeys(
            (
                "TRACKING_URI_ENV",
                "Tracker",
                "dataset_input",
                "default_tracking_uri",
                "flat_params",
                "run_name",
            ),
            "p4bench.tracking.tracker",
        ),
        "EXPERIMENT_KIND_TAG": "p4bench.tracking.ops",
    },
)
