"""P4L: privacy-preserving peer-to-peer learning over Paillier-encrypted synergy chains."""

from p4bench.hookspecs import hookimpl
from p4bench.plugins.p4l.method import P4L


@hookimpl
def register_methods():
    return [P4L]
