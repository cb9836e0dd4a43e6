"""A smoke test of ``lossreduce bench --many-runs`` at tiny sizes (not timed):
every check of the soak holds, and the figures come back."""

from __future__ import annotations

from lossreduce.bench.many_runs import ManyRunsSettings, format_many_runs, run_many_runs


def test_many_runs_soak_smoke() -> None:
    settings = ManyRunsSettings(
        jobs=2,
        ranks=3,
        rounds=16,
        run_rounds=2,
        single_job_rounds=2,
        idle_ttl_s=0.5,
        # Short sweeps (min(5 s, round timeout)) keep the TTL waits short; long enough
        # that a loaded machine does not time a round out.
        round_timeout_s=3.0,
        seed=0,
    )
    report = run_many_runs(settings)
    many = report["many_runs"]
    assert isinstance(many, dict)
    assert many["rounds"] == 16
    assert (many["wrong_answers"], many["lost_answers"]) == (0, 0)
    assert many["collisions_leaked"] == many["foreign_token_leaked"] == 0
    assert many["foreign_token_refused"] >= 2
    # seed 0 makes each kind of next run happen at least once.
    assert many["collisions_refused_on_every_rank"] == many["resumes"] >= 1
    assert many["name_reuses"] >= 1
    after = report["after_idle"]
    assert isinstance(after, dict)
    # Every job's series and claim retired once the jobs went idle.
    assert (after["series"], after["journal_claims"]) == (0, 0)
    assert "single_job" in format_many_runs(report)
