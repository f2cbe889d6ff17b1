"""One run: prepare it (`runner.prepare`), drive it round by round with checkpoints and a
clean stop on Ctrl-C (`runner.run`, `session`, `checkpoint`, `interrupts`), check the job
before it starts (`preflight`), and what it prints and records (`summary`, `artifacts`,
`privacy`). The modules were in the package root before 0.2; their old paths still import,
with a deprecation warning (`p4bench.moved`)."""
