"""``vmm-core bench``: the benchmarks, the host demo and the benchmark models.

Nothing in the library imports this package, and it imports only vmm_core's public API
(docs/api.md; ``tests/test_bench_public_api.py`` holds it to that): what the benchmark
cannot reach there, it builds itself (:mod:`.host_mapping`, the ranks' exchange in
:mod:`.distributed`) or does not measure.  The CLI (:mod:`vmm_core.cli`) checks every
flag and builds one :class:`~.spec.BenchSpec`; :func:`.runner.run_bench` runs it.  The
layers point one way::

    cli -> runner -> scenario modules -> shared parts
           (graph_memory, piecewise,      (spec, scenarios, measure, report, children,
            rl, rl_group, sleep,           progress, workload, models, peers, extras,
            group_sleep, distributed,      exec_policies, serving, group_run,
            host_demo)                     group_report, piecewise_runners)

* :mod:`.spec`: the typed values of a run; no module below the CLI reads argparse.
* :mod:`.scenarios`: the one table of ``--scenario`` names (help, checks, dispatch).
* :mod:`.children`: one process per configuration; :meth:`.spec.BenchSpec.child_argv`
  starts it with the same flags, so parent and child build the same spec.
* :mod:`.report`: table (:data:`.report.COLUMNS`), headline and JSON of the graph
  memory records; :mod:`.measure`: device memory readings every scenario shares.
* :mod:`.group_run`: what the torchrun benchmarks share (the group prepared, barriers,
  every rank's copy limits); :mod:`.group_report`: the RL step's per-rank table and
  targets, and round 1 against a one-GPU run.
* :mod:`.exec_policies`: the ``--executables`` policies and what GraphPool takes for
  each; :mod:`.serving`: the serving trace and the sleep/wake check every engine-runner
  configuration runs after its captures.
* :mod:`.piecewise_runners`: the engine-shaped runners the engine-runner scenarios and
  the RL step capture with; :mod:`.piecewise_report` and :mod:`.rl_report` print a
  scenario's records; :mod:`.rl_strategies`: the RL scenario's strategies.

How to add:

* a scenario: one entry in :data:`.scenarios.SCENARIOS` naming its runner
  ``function(spec, backend)`` and its child ``function(spec) -> (record, ok)``.
* a strategy of the engine-runner scenarios (piecewise, families, whole, ondemand):
  one :class:`.peers.Discipline` in :data:`.peers.DISCIPLINES`; ``--strategies`` and its
  default follow the table.
* a strategy of the RL scenario: an ``_Engine`` subclass in :mod:`.rl_strategies` (its
  sleep, wake and where weights, KV cache and graphs live; ``_Tagged`` for one whose
  memory is vmm_core tags) and one :class:`.rl_strategies.Strategy` line in
  :data:`.rl_strategies.STRATEGIES` (``needs``: the package it imports, so it runs only
  where that is installed); ``--strategies`` takes its name.
* a peer of the sleep benchmark: a function ``run(case) -> rows | note`` over one size
  (:class:`.sleep.Case`; ``case.own_bytes(region)`` makes its bytes on a device or the
  host backend) and one :class:`.sleep.Peer` line in :data:`.sleep.PEERS` (``host``: it
  runs on the host backend too); ``--sleep-rows`` takes its name.
* a column of the graph memory table: a key in the child's record and one
  :class:`.report.Column` in :data:`.report.COLUMNS`.
* a new knob of a scenario family (as ``--executables`` of the engine-runner scenarios):
  a field of that family's spec (:class:`.spec.EngineSpec`),
  the flag that fills it in :func:`.cli.bench_spec` (and the same flag in
  :meth:`.spec.BenchSpec.child_argv` when the children need it), then read
  ``spec.engine.<field>`` in the child (:func:`.piecewise.run_one_piecewise`).
"""
