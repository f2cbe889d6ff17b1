"""Where a run's results go: the MLflow tracker and its local copy (`tracker`), the worker that
logs to MLflow off the training thread (`worker`), the store's operations (`ops`, `store`), where
runs are logged (`stores`), the links a run prints (`links`) and P4L's participation curves
(`participation`).

`p4bench.tracking` was one module until 0.2; its names still resolve here, with a deprecation
warning naming their module now, for one minor version.
"""

from __future__ import annotations

from p4bench.moved import forward_moved

__getattr__ = forward_moved(
    __name__,
    {
        **dict.fromkeys(
            ("Tracker", "dataset_input", "flat_params", "run_name"), "p4bench.tracking.tracker"
        ),
        **dict.fromkeys(("TRACKING_URI_ENV", "default_tracking_uri"), "p4bench.tracking.stores"),
        "EXPERIMENT_KIND_TAG": "p4bench.tracking.ops",
    },
)
