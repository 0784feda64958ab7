"""Studies: sweeps of runs, their collected tables, scaling-law fits and plots."""
