"""`p4bench device init | serve | launch`."""

from __future__ import annotations

import inspect
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

import typer

from p4bench.errors import P4BenchError

app = typer.Typer(
    name="device",
    help="Run a method on real devices (Raspberry Pis): certificates, peers, launch. See docs/device.md.",
    no_args_is_help=True,
)

_PEERS = typer.Option(
    ..., "--peers", help="peers file (YAML): id, host, port (and client or role) of every node"
)
_TLS = typer.Option(..., "--tls-dir", help="folder with ca.pem and the node's <id>.pem / <id>.key")


@app.command("init")
def init_command(
    peers: Path = _PEERS,
    tls_dir: Path | None = typer.Option(
        None,
        "--tls-dir",
        help="folder to create the CA and certificates in (default: tls/ next to the peers file)",
    ),
    days: int = typer.Option(30, help="validity of the certificates in days"),
    overwrite: bool = typer.Option(
        False, help="replace an existing CA (invalidates its certificates)"
    ),
) -> None:
    """Create a run CA and one certificate per peer (and for the launcher)."""
    from p4bench_device.peers import PeersFile
    from p4bench_device.tls import LAUNCHER, init_tls_dir

    spec = PeersFile.load(peers)
    tls_dir = tls_dir or peers.parent / "tls"
    init_tls_dir(tls_dir, [(p.id, [p.host]) for p in spec.peers], days=days, overwrite=overwrite)
    typer.echo(f"created the run CA and {len(spec.peers) + 1} certificates in {tls_dir}")
    for p in spec.peers:
        typer.echo(
            f"  {p.id} ({p.role}{'' if p.role == 'server' else ' ' + str(p.node)}, {p.host}:{p.port}): "
            f"copy ca.pem {p.id}.pem {p.id}.key"
        )
    typer.echo(f"  launcher: ca.pem {LAUNCHER}.pem {LAUNCHER}.key   (keep ca.key off the devices)")


@app.command("serve")
def serve_command(
    peer_id: str = typer.Option(..., "--peer-id", help="this node's id in the peers file"),
    listen: str = typer.Option(
        ..., "--listen", help="HOST:PORT to listen on (0.0.0.0:PORT on a device)"
    ),
    peers: Path = _PEERS,
    tls_dir: Path = _TLS,
    power_command: str | None = typer.Option(
        None, help="command (or python:module:function) printing watts, sampled during phases"
    ),
    power_interval: float = typer.Option(1.0, help="seconds between power samples"),
    threads: int | None = typer.Option(None, help="torch threads (default: all cores)"),
    keep_serving: bool = typer.Option(
        False, help="serve one run after another instead of exiting after one"
    ),
    idle_timeout: float | None = typer.Option(
        None, help="exit when no run starts within this many seconds (default: wait)"
    ),
    device_profile: str | None = typer.Option(
        None,
        help="limit this process like a device where the OS allows: rpi4 (4 CPUs, 4 GiB address space)",
    ),
    log_level: str = typer.Option("INFO", help="DEBUG | INFO | WARNING | ERROR"),
    owner_pid: int | None = typer.Option(
        None,
        hidden=True,
        help="local peers: exit, removing --tls-dir, when this process (the launcher) ends",
    ),
) -> None:
    """Run one peer: wait for the launcher, run its client, report, exit (or, with
    --keep-serving, wait for the next run)."""
    if (
        owner_pid is not None
    ):  # first, before the slow imports: the launcher may die during start-up
        from p4bench_device.orphans import exit_with_owner

        exit_with_owner(owner_pid, tls_dir)
    from p4bench_device.node import serve

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [peer {peer_id}] %(message)s",
    )
    serve(
        peer_id,
        listen,
        str(peers),
        str(tls_dir),
        power=power_command,
        power_interval=power_interval,
        threads=threads,
        keep_serving=keep_serving,
        idle_timeout=idle_timeout,
        device_profile=device_profile,
    )


def _launch_command(**values: Any) -> None:
    from p4bench.cli.run import run_command
    from p4bench_device.peers import PeersFile

    peers, tls_dir = values.pop("peers"), values.pop("tls_dir")
    tls_dir = tls_dir or Path(peers).parent / "tls"
    values["runtime"], values["local_peers"] = "device", None
    values["clients"] = values.get("clients") or PeersFile.load(peers).num_clients
    values["option"] = [
        *(values.get("option") or []),
        f"device_peers={json.dumps(str(peers))}",
        f"device_tls_dir={json.dumps(str(tls_dir))}",
    ]
    run_command(**values)


def _launch_signature() -> inspect.Signature:
    """`p4bench run`'s options (but --runtime and --local-peers) after --peers and --tls-dir."""
    from p4bench.cli.run import run_command

    hints = typing.get_type_hints(run_command)
    own = [
        inspect.Parameter("peers", inspect.Parameter.KEYWORD_ONLY, default=_PEERS, annotation=Path),
        inspect.Parameter(
            "tls_dir",
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Path | None,
            default=typer.Option(
                None,
                "--tls-dir",
                help="folder with ca.pem and launcher.pem / launcher.key (default: tls/ next to the peers file)",
            ),
        ),
    ]
    inherited = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(run_command).parameters.values()
        if p.name not in ("runtime", "local_peers")
    ]
    return inspect.Signature(own + inherited)


def register(app_: typer.Typer) -> None:
    signature = _launch_signature()
    _launch_command.__signature__ = signature  # type: ignore[attr-defined]
    _launch_command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    _launch_command.__doc__ = (
        "Start a run across the peers of a peers file (each already running `p4bench device "
        "serve`), distribute the config and seed, and log every peer's results to MLflow."
    )
    if not any(c.name == "launch" for c in app.registered_commands):
        app.command("launch")(_launch_command)
    app_.add_typer(app, name="device")


def main() -> None:
    """`python -m p4bench_device ...` (used to start local peers)."""
    from p4bench.cli import err_console

    try:
        app(prog_name="p4bench device")
    except P4BenchError as exc:
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
