"""The kernel-config tuner behind `attnbench tune`.

Modules, one job each: problem (what a study tunes, study names), space (search spaces from
search_spaces/*.toml), objective (the trial protocol and a deterministic fake), engine_objective
(the real GPU objective), timing (the suite runner's timer and L2 policy), workers (isolated
compile/benchmark processes), storage (Optuna storage and recovery of dead trials), loop (one
GPU worker's ask/tell loop), confirm (A/B timing of the winner against the baseline), publish
(the tune-file rule), runner (a whole study), progress (the live display), compare (grid vs
Optuna record). Importing this package is cheap; import the module you need.
"""
