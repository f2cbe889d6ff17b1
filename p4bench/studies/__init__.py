"""Studies: many runs and what is read from them. Sweeps (`sweep`, `sweep_plan`,
`sweep_privacy`), lr tuning (`tune`, `tune_federation`, `tune_scope`), paper reproductions
(`reproduce`), comparisons and attack impact (`compare`, `impact`) at equal privacy
(`equal_privacy`), the backends that execute runs (`backends`, `ray_cluster`) and the
results table (`results`). The modules were in the package root before 0.2; their old paths
still import, with a deprecation warning (`p4bench.moved`)."""
