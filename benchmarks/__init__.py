"""fxpar benchmarks: scripts that print a table and write JSON under benchmarks/results/."""
