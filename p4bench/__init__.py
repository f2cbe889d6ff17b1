"""p4bench: a benchmark suite for differentially private, peer-to-peer, personalized learning.

Plugins implement the hooks in `p4bench.hookspecs` with `p4bench.hookimpl`.
"""

from p4bench import moved as _moved
from p4bench.hookspecs import hookimpl
from p4bench.version import __version__

_moved.install()  # old import paths of moved modules still work, with a warning

__all__ = ["__version__", "hookimpl"]
