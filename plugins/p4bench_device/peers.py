"""The peers file: which node runs where.

```yaml
peers:
  - id: pi-0              # the certificate's common name; letters, digits, '-'
    host: 192.168.1.20    # address the other nodes and the launcher connect to
    port: 8443
    client: 0             # client id it holds (default: its position among clients)
  - id: pi-1
    host: 192.168.1.21
    port: 8443
  - id: hub               # only for server-based methods (FedAvg): the server node
    host: 192.168.1.30
    port: 8443
    role: server
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from p4bench.errors import UsageError
from p4bench.rng import SERVER_ID
from p4bench_device.tls import LAUNCHER

__all__ = ["PeerSpec", "PeersFile", "ID_PATTERN"]

ID_PATTERN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class PeerSpec:
    """One node: its id, where it listens, and the client (or the server, -1) it holds."""

    id: str
    host: str
    port: int
    node: int

    @property
    def role(self) -> str:
        return "server" if self.node == SERVER_ID else "client"

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": self.id, "host": self.host, "port": self.port}
        entry.update({"role": "server"} if self.node == SERVER_ID else {"client": self.node})
        return entry


@dataclass(frozen=True)
class PeersFile:
    """Every node of a deployment, validated (unique ids, clients 0..N-1)."""

    peers: tuple[PeerSpec, ...]

    def __post_init__(self) -> None:
        ids = [p.id for p in self.peers]
        if len(set(ids)) != len(ids):
            raise UsageError(f"peer ids must be unique, got {ids}")
        clients = sorted(p.node for p in self.peers if p.node != SERVER_ID)
        if clients != list(range(len(clients))):
            raise UsageError(
                f"clients must be numbered 0..{len(clients) - 1} once each, got {clients}"
            )
        if sum(p.node == SERVER_ID for p in self.peers) > 1:
            raise UsageError("at most one peer can have role: server")
        if not clients:
            raise UsageError("the peers file lists no client")

    @property
    def by_id(self) -> dict[str, PeerSpec]:
        return {p.id: p for p in self.peers}

    @property
    def by_node(self) -> dict[int, PeerSpec]:
        return {p.node: p for p in self.peers}

    @property
    def num_clients(self) -> int:
        return sum(p.node != SERVER_ID for p in self.peers)

    @property
    def server(self) -> PeerSpec | None:
        return self.by_node.get(SERVER_ID)

    def get(self, peer_id: str, source: str = "the peers file") -> PeerSpec:
        try:
            return self.by_id[peer_id]
        except KeyError:
            raise UsageError(
                f"peer '{peer_id}' is not in {source}; peers: {', '.join(self.by_id)}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {"peers": [p.to_dict() for p in self.peers]}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @staticmethod
    def load(path: str | Path) -> PeersFile:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"peers file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise UsageError(f"peers file {path} is not valid YAML: {exc}") from None
        return PeersFile.parse(data, str(path))

    @staticmethod
    def parse(data: object, source: str = "peers") -> PeersFile:
        """Validate a peers mapping (as loaded from YAML or received from the launcher)."""
        if not isinstance(data, dict) or not isinstance(data.get("peers"), list):
            raise UsageError(f"{source}: expected a mapping with a list 'peers'")
        specs, position = [], 0
        for index, entry in enumerate(data["peers"]):
            where = f"{source}: peers[{index}]"
            if not isinstance(entry, dict):
                raise UsageError(f"{where} must be a mapping with id, host, port")
            unknown = set(entry) - {"id", "host", "port", "client", "role"}
            if unknown:
                raise UsageError(f"{where} has unknown keys {sorted(unknown)}")
            peer_id, host, port = str(entry.get("id", "")), entry.get("host"), entry.get("port")
            if not ID_PATTERN.match(peer_id) or peer_id == LAUNCHER:
                raise UsageError(
                    f"{where}: id {peer_id!r} must be letters, digits and '-' (and not '{LAUNCHER}')"
                )
            if not isinstance(host, str) or not host or len(host) > 253:
                raise UsageError(f"{where}: host must be an address or host name")
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise UsageError(f"{where}: port must be an integer in [1, 65535], got {port!r}")
            role = entry.get("role", "client")
            if role not in ("client", "server"):
                raise UsageError(f"{where}: role must be client or server, got {role!r}")
            if role == "server":
                if "client" in entry:
                    raise UsageError(f"{where}: a server holds no client")
                node = SERVER_ID
            else:
                node = entry.get("client", position)
                if isinstance(node, bool) or not isinstance(node, int) or node < 0:
                    raise UsageError(f"{where}: client must be an integer >= 0, got {node!r}")
                position += 1
            specs.append(PeerSpec(peer_id, host, port, node))
        return PeersFile(tuple(specs))
