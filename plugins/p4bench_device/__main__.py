"""`python -m p4bench_device serve ...`: the peer command without the full CLI."""

from p4bench_device.cli import main

main()
