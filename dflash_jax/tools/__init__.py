"""Tools on top of the library: the AOT planner, the mesh experiment, HLO statistics, profiling,
FLOP counts and the benchmarks. Nothing in the library (target, drafter, data, training, decoding,
checkpoint, loading, convert) imports this package; entry points pass what they need in (e.g.
``train`` hands ``plan.check_run_fits`` to ``training.run.run`` as its pre-flight check)."""
