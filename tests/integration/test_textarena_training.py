"""`agentrl grpo --config textarena` as shipped: the embedded model learns the scripted GuessTheNumber player's
demonstrations (SFT), then GRPO must raise its held-out win rate (docs/ecosystems-textarena.md)."""

import pytest

pytest.importorskip("textarena")


@pytest.mark.slow
def test_grpo_after_sft_raises_the_held_out_win_rate(tmp_path):
    from agentrl.jobs.ppo import load_job, run_job

    # 208 s on 2 cores shared with three other jobs: SFT 600 steps (~3 min), GRPO 30 steps, four evaluations.
    job = load_job("textarena", [f"out_dir={tmp_path / 'run'}", f"model.base_dir={tmp_path / 'base'}",
                                 "progress=false"])
    summary = run_job(job)
    before, after = summary["before"]["accuracy"], summary["after"]["accuracy"]  # greedy win rates, 200 games
    before_t1, after_t1 = summary["before_sampled"]["accuracy"], summary["after_sampled"]["accuracy"]
    # Measured: greedy 0.50 -> 1.00 (the SFT model takes the range's low end, a linear search that wins only on
    # the numbers 1-4; GRPO makes halving the greedy move), sampled 0.835 -> 0.935.
    assert after >= before + 0.3, (before, after)
    assert after_t1 >= before_t1 + 0.05, (before_t1, after_t1)
    assert summary["after"]["mean_turns"] < summary["before"]["mean_turns"]  # halving wins in fewer guesses
