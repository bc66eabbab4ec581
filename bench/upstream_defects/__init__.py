"""A blind benchmark of sleuth on defects planted in real upstream DFlash code (speculators, SpecForge,
z-lab/dflash). The defects are data (`defects.yaml`); sleuth is run only through its CLI. See
`python -m bench.upstream_defects --help` and BENCHMARKS.md."""
