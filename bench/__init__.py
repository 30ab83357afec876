"""autoshard's benchmarks: ``python -m bench [names...] [--quick]`` from the repository root.

Why one runner: every benchmark then records the same machine facts and the exact command next
to its numbers, and ``bench/RESULTS.md`` is always regenerated from the stored JSON, so the
markdown can never drift from the data it claims to show.

Adding a benchmark means adding one file, ``bench/bench_<name>.py``, that defines:

``NAME: str``
    ``"<name>"``, the file name without ``bench_``. It names the benchmark on the command line
    and its result file, ``bench/results/<name>.json``.
``run(quick: bool) -> dict``
    Measure and return JSON-able results (plain dicts, lists, str, int, float, bool, None).
    ``quick`` asks for a small configuration that finishes in seconds, for smoke tests.
    Raise if anything measured is wrong (e.g. a result that does not match its reference):
    a failed benchmark writes nothing. Spawn ranks only with
    :func:`autoshard.testing.run_ranks`, from module-level functions.
``summary(result: dict) -> str``
    Markdown for ``bench/RESULTS.md``, built only from ``result`` (what ``run`` returned,
    possibly read back from JSON written by an older run). The runner adds the ``## <name>``
    heading and a provenance line above it.

``unavailable() -> str | None`` (optional)
    Why this machine cannot run the benchmark (e.g. it needs a GPU), or None. The runner then
    says so, skips it without failing, and keeps its stored result.
``__doc__``
    What it measures; ``python -m bench NAME --help`` prints it.

The runner stores ``{"name", "command", "quick", "date", "machine", "elapsed_s", "result"}`` in
the JSON file; benchmarks need not record the torch version, CPU count, date or command.
"""
