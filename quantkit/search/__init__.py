"""Mixed-precision search: sensitivity, cost, solver, sweeps."""
