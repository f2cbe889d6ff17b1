"""The package version, in a module of its own so that internal code never imports the
`p4bench` facade for it."""

__version__ = "0.2.0"
