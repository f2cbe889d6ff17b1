"""The summary table a run ends with: every figure the run reports, in words.

Besides accuracy and epsilon: the accuracies of a method's other models (P4's proxy:
`accuracy_<name>_mean`), the bytes sent in all and per phase, and the time per phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["print_links", "print_summary", "rejections_line"]


def _accuracy_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The accuracy rows, the headline (`--eval`) first: each client's own test split
    (personal) and, where measured, the global test set."""
    personal = [
        ("test accuracy mean (own test splits)", f"{summary['accuracy_mean']:.4f}"),
        *_spread_rows(summary, "accuracy"),
    ]
    if "accuracy_global_mean" not in summary:
        return [("test accuracy mean", personal[0][1])] + [
            (f"test accuracy {key.strip()}", value) for key, value in personal[1:]
        ]
    held = [
        ("test accuracy mean (global test set)", f"{summary['accuracy_global_mean']:.4f}"),
        *_spread_rows(summary, "accuracy_global"),
    ]
    return held + personal if summary.get("eval_set") == "global" else personal + held


def _spread_rows(summary: Mapping[str, Any], prefix: str) -> list[tuple[str, str]]:
    """min / max, and std / p10 (the bottom decile) where the summary has them."""
    rows = [("  min / max", f"{summary[f'{prefix}_min']:.4f} / {summary[f'{prefix}_max']:.4f}")]
    if f"{prefix}_std" in summary:
        rows.append(
            (
                "  std / p10 (bottom decile)",
                f"{summary[f'{prefix}_std']:.4f} / {summary[f'{prefix}_p10']:.4f}",
            )
        )
    return rows


def _unseen_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`--unseen-fraction`: the clients that joined after training, fine-tuned on their own
    data, on their own test splits; their epsilon (the fine-tune's) apart from the others'."""
    if "accuracy_unseen_mean" not in summary:
        return []
    setup = summary.get("unseen_fine_tune") or {}
    rows = [
        (
            "unseen clients",
            f"{summary['unseen_clients']} joined after training: from {setup.get('start', '?')}, "
            f"{setup.get('steps', '?')} local DP steps on their own data",
        ),
        (
            "  test accuracy mean",
            f"{summary['accuracy_unseen_mean']:.4f} (std {summary['accuracy_unseen_std']:.4f}, "
            f"p10 {summary['accuracy_unseen_p10']:.4f})",
        ),
    ]
    if summary.get("epsilon_unseen") is not None:
        rows.append(
            (
                "  unseen clients' epsilon",
                f"{summary['epsilon_unseen']:.3f} max ({summary.get('accountant')}): their "
                "fine-tune's; not in the epsilon below",
            )
        )
    if setup.get("verification"):
        rows.append(("  verification", f"[yellow]{setup['verification']}[/yellow]"))
    return rows


def print_summary(console: Console, summary: Mapping[str, Any]) -> None:
    table = Table(
        title=f"{summary['method']} on {summary['dataset']} (seed {summary['seed']})",
        show_header=False,
    )
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("attack / defense", f"{summary['attack'] or 'none'} / {summary['defense'] or 'none'}"),
        ("rounds", _rounds_text(summary)),
        (
            "reported clients",
            f"{summary['reported_clients']} of {summary['clients']} (benign, non-evaluation"
            + (", trained)" if summary.get("unseen_clients") else ")"),
        ),
        *_accuracy_rows(summary),
        *_other_accuracy_rows(summary),
        *_unseen_rows(summary),
        ("epsilon", _claim_text(summary)),
        *_evaluation_rows(summary),
        ("DP randomness", _randomness_text(summary)),
        *_communication_rows(summary),
        (
            "wall time",
            f"{summary['wall_time_s']:.2f} s on {summary.get('compute_device', 'cpu')}"
            + _threads_text(summary.get("threads"))
            + (
                " (client data streamed from host memory)"
                if summary.get("device.data_placement") == "streamed"
                else ""
            )
            + (
                f"; its verification {summary['verification_wall_s']:.2f} s more"
                if summary.get("verification_wall_s") and not summary.get("verification_cached")
                else ""
            ),
        ),
        ("MLflow run", f"{summary.get('run_id')} at {summary.get('tracking_uri')}"),
        ("local results", str(summary.get("results_dir"))),
    ]
    if summary.get("tracking_error"):
        rows.append(
            ("tracking", f"[yellow]{summary['tracking_error']}; results kept locally[/yellow]")
        )
    device = summary.get("device")
    if isinstance(device, dict) and device.get(
        "self_reported"
    ):  # a device run: taken from the peers unchecked
        claimed = ", ".join(map(str, device["self_reported"])).replace("_", " ")
        rows.insert(
            [k for k, _ in rows].index("epsilon"),
            (
                "self-reported",
                f"[yellow]{claimed}: each peer's figures "
                "of its own client, not checked by the launcher[/yellow]",
            ),
        )
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    print_links(console, summary)
    if summary.get(
        "rejected_messages"
    ):  # what peers sent that the receive gate refused: the last line
        console.print(
            f"[yellow]{escape(rejections_line(summary['rejections']))}[/yellow]",
            highlight=False,
            soft_wrap=True,
        )


def print_links(console: Console, summary: Mapping[str, Any]) -> None:
    """A tracked run's MLflow runs table, its own page and the compare command, one a line
    (`p4bench.tracking.links`); nothing for a run MLflow does not hold."""
    from p4bench.tracking.links import where_to_look

    if summary.get("tracked") and summary.get("tracking_uri") and summary.get("run_id"):
        for line in where_to_look(str(summary["tracking_uri"]), run_id=str(summary["run_id"])):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def rejections_line(rejections: dict[str, int]) -> str:
    """One line naming every rejection: reason, sender and count, most frequent first."""
    ranked = sorted(rejections.items(), key=lambda item: (-item[1], item[0]))
    total = sum(rejections.values())
    return f"rejected {total} message{'s' if total != 1 else ''}: " + ", ".join(
        f"{what} ({n})" for what, n in ranked
    )


def _rounds_text(summary: Mapping[str, Any]) -> str:
    phases = summary.get("phases") or {}
    before = [
        f"{name} ({p['completed']} round{'s' if p['completed'] != 1 else ''})"
        for name, p in list(phases.items())[:-1]
    ]
    if not summary.get("stopped_by_time_budget"):
        return str(summary["rounds"]) + (f", after {', '.join(before)}" if before else "")
    past = int(summary.get("rounds_past_budget") or 0)
    beyond = f" ({past} more ran past it)" if past else ""
    return (
        f"[yellow]{summary['rounds_completed']} of {summary['rounds']}: stopped by the time budget "
        f"({summary['time_budget_min']:g} min){beyond}; accuracy of round {summary['rounds_completed']}[/yellow]"
    )


NO_DP = "none (no DP)"  # the epsilon of a non-private run: never a number (0.000 would read as perfect privacy)


def is_private(summary: Mapping[str, Any]) -> bool:
    """Whether the run trained through the DP mechanism: its `private` key (the
    certification), else whether it carries an epsilon."""
    private = summary.get("private")
    return bool(private) if private is not None else summary.get("epsilon") is not None


def _claim_text(summary: Mapping[str, Any]) -> str:
    """The epsilon row: a certified figure plainly; an uncertified one in red, never as a
    plain number; a non-private run `none (no DP)`, never a number nor a certificate."""
    if not is_private(summary):
        return f"[yellow]{NO_DP}[/yellow]"
    if summary.get("epsilon") is None:  # private, yet no ledger figure: nothing to certify
        return "[red]not recorded[/red] (a private run whose ledger reported no epsilon)"
    text = _privacy_text(summary)
    if summary.get("epsilon_scope"):  # stopped by the time budget: the epsilon of the rounds taken
        text += f"; epsilon of the {summary['epsilon_scope']}"
    if summary.get("epsilon_certified") is False:
        return f"[bold red]UNCERTIFIED[/bold red] [red]{text}; why: {summary.get('uncertified_reason')}[/red]"
    if (
        summary.get("post_processing", "verified") != "verified"
    ):  # the check did not run (P4BENCH_VERIFY=0)
        return f"[green]certified[/green] {text} [yellow](post-processing {summary['post_processing']})[/yellow]"
    isolation = summary.get("record_isolation", "not run")
    checked = (
        "post-processing and record isolation verified"
        if isolation == "verified"
        else (f"post-processing verified, record isolation {isolation}")
    )
    where = {"run": " on the run itself", "size": " at the run's size beside it"}.get(
        summary.get("verification_scope") or "", ""
    )
    reused = (
        " (the verdict of an earlier run of this configuration and code)"
        if summary.get("verification_cached")
        else ""
    )
    return f"[green]certified[/green] {text}; {checked}{where}{reused}"


def _evaluation_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A private run's evaluation clients' own epsilon (they are reserved for tuning and
    are not among the reported clients, yet they train in the run); no row where the run is
    non-private or has no evaluation clients."""
    if not is_private(summary) or summary.get("epsilon") is None:
        return []
    count = summary.get("evaluation_clients")
    if count == 0:
        return []
    value = summary.get("epsilon_evaluation_clients")
    if value is None:
        return [("evaluation clients' epsilon", "[yellow]not known[/yellow]")]
    whom = f"the {count} evaluation clients" if count else "the evaluation clients"
    uncertified = (
        " [red](UNCERTIFIED, as the run's)[/red]"
        if summary.get("epsilon_certified") is False
        else ""
    )
    return [
        (
            "evaluation clients' epsilon",
            f"{value:.3f} max over {whom} ({summary.get('accountant')}) in this run"
            f"{uncertified}; not in the figure above, which is the reported clients'",
        )
    ]


def _threads_text(threads: int | None) -> str:
    """The wall time row's ", N threads" (summaries written before issue 49 have none)."""
    if not threads:
        return ""
    return f", {threads} thread{'s' if threads != 1 else ''}"


def _randomness_text(summary: Mapping[str, Any]) -> str:
    from p4bench.privacy.certification import RANDOMNESS_LABELS

    source = "secure" if summary.get("dp_randomness") == "secret" else "seeded"
    return RANDOMNESS_LABELS[source] if summary.get("private") else "n/a"


def _privacy_text(summary: Mapping[str, Any]) -> str:
    if summary.get("epsilon") is None:
        return "non-private"
    pld = (
        f", {summary['epsilon_pld']:.3f} max (pld)"
        if summary.get("epsilon_pld") is not None and summary["accountant"] != "pld"
        else ""
    )
    label = summary[
        "accountant"
    ]  # an accountant used outside its proof (noble) makes the run uncertified
    return (
        f"{summary['epsilon']:.3f} max / {summary['epsilon_mean']:.3f} mean ({label}), "
        f"{summary['epsilon_rdp']:.3f} max (rdp){pld}; delta {summary['delta']:.2g}, "
        f"sigma {summary['noise_multiplier']:.3f}, "
        f"{summary['neighbouring']}; {summary['clients_stopped']} clients hit the budget"
    )


# accuracies the summary rows show already (the headline, per client, the global test set's)
_SHOWN = {
    "accuracy_mean",
    "accuracy_min",
    "accuracy_max",
    "accuracy_per_client",
    "accuracy_global_mean",
    "accuracy_global_min",
    "accuracy_global_max",
    "accuracy_evaluation_mean",
    "accuracy_unseen_mean",
}


def _other_accuracy_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A row per accuracy of a method's other models (`accuracy_<name>_mean`, e.g. P4's
    proxy), over the same reported clients."""
    rows = []
    for key, value in summary.items():
        if (
            key.startswith("accuracy_")
            and key.endswith("_mean")
            and key not in _SHOWN
            and isinstance(value, float)
        ):
            rows.append(
                (
                    f"{key[len('accuracy_') : -len('_mean')].replace('_', ' ')} accuracy mean",
                    f"{value:.4f}",
                )
            )
    return rows


def _bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def _communication_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Bytes sent (all, per phase, per client) and time per phase, where the run has them."""
    rows = []
    if isinstance(summary.get("bytes_sent"), (int, float)):
        phases = summary.get("bytes_per_phase") or {}
        per_phase = (
            f" ({', '.join(f'{name} {_bytes(v)}' for name, v in phases.items())})"
            if len(phases) > 1
            else ""
        )
        client = summary.get("client_bytes_sent") or {}
        per_client = (
            f"; per client {_bytes(client['mean'])} mean, {_bytes(client['max'])} max"
            if {"mean", "max"} <= set(client)
            else ""
        )
        rows.append(("bytes sent", f"{_bytes(summary['bytes_sent'])}{per_phase}{per_client}"))
    seconds = summary.get("seconds_per_phase") or {}
    if seconds:
        rows.append(
            (
                "time per phase",
                ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items()),
            )
        )
    return rows
