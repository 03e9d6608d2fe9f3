"""``probe-v6/bounce``: v5's step over segments of 8 slots, levels 0-7 (datamodules/probe.py). The levels
past 4 are where one layer's table of input combinations (10^(d+1)) stops being learnable, so the
shortcut ceilings that matter are those of a shallow reading; they are computed exactly here by dynamic
programming over the running value (15 states), not by enumerating 10^8 inputs."""
from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest

from datamodules import probe
from tests.conftest import bounce_segments, solved_level_counts

TASK = "probe-v6/bounce"
TOP = probe.BOUNCE_WIDE_LEVELS
SLOTS = TOP + 1  # operand slots
EPISODES = 300  # 3,000 segments, ~375 per level
STATES = probe.BOUNCE_LIMIT + 1  # the running value stays in 0..BOUNCE_LIMIT


def _segments(count=EPISODES):
    """(level, operands, result) of every segment of the first ``count`` episodes, read by position."""
    return bounce_segments(TASK, SLOTS, count)


# ---------------------------------------------------------------------------- generator vs brute force
def test_the_solver_re_derives_every_label_and_every_level_0_to_7_occurs():
    seen = solved_level_counts(TASK, EPISODES)
    segments = EPISODES * ((probe.EPISODE_LEN - 1) // (SLOTS + 4))
    assert sum(seen.values()) == 2 * segments and set(seen) == set(range(TOP + 1))
    assert all(seen[k] > 0.09 * segments for k in range(1, TOP + 1))  # d uniform in 0..7: 1/8 each


def test_results_are_v5s_step_composed_in_order_and_the_level_is_the_number_of_steps():
    for level, operands, result in _segments():
        value = operands[0]
        for x in operands[1:]:  # written out: add within the limit, else reflect
            value = value + x if value + x <= probe.BOUNCE_LIMIT else abs(value - x)
        assert level == len(operands) - 1 and result == value


def test_the_solver_catches_a_wrong_result_a_wrong_tens_digit_and_v5s_layout():
    family, (data, levels) = probe.episode(TASK, 3)
    units = levels.index(max(levels))
    wrong = bytearray(data)
    wrong[units] = ord("0") + (data[units] - ord("0") + 1) % 10
    assert probe.solve_episode(family, bytes(wrong), "v6")[units] == (data[units], max(levels))
    with pytest.raises(ValueError, match="is not 8 slots"):
        probe.solve_episode(family, data[1:], "v6")  # every segment shifted by one byte
    with pytest.raises(ValueError, match="is not 8 slots"):
        probe.solve_episode(family, probe.episode("probe-v5/bounce", 3)[1][0], "v6")  # v5's 5 slots
    tens = bytearray(data)
    tens[units - 1] = ord("1") if data[units - 1] == ord("0") else ord("0")
    with pytest.raises(ValueError, match="does not hold its result"):
        probe.solve_episode(family, bytes(tens), "v6")


# ---------------------------------------------------------------------------- shallow readings, exactly
def _state_after(steps):
    """The exact distribution of the running value after x0 and ``steps`` further steps (inputs uniform)."""
    p = np.zeros(STATES)
    p[:10] = 0.1
    for _ in range(steps):
        q = np.zeros(STATES)
        for s, x in itertools.product(range(STATES), range(10)):
            q[probe.bounce(s, x)] += p[s] / 10
        p = q
    return p


def _best_from_last(level, m):
    """Accuracy of the Bayes guess of the units digit from the last m operands and the tens digit."""
    assert 1 <= m <= level, (level, m)  # m operands of the level + 1; m = level + 1 would be the answer itself
    prefix = _state_after(level - m)  # the value the first level + 1 - m operands leave
    mass = defaultdict(lambda: np.zeros(10))
    for suffix in itertools.product(range(10), repeat=m):
        for s in range(STATES):
            value = s
            for x in suffix:
                value = probe.bounce(value, x)
            mass[suffix, value // 10][value % 10] += prefix[s] / 10 ** m
    return sum(v.max() for v in mass.values())


def _value_and_sum(level):
    """The exact joint distribution {(running value, plain sum): probability} after x0 and ``level`` steps."""
    joint = defaultdict(float, {(x, x): 0.1 for x in range(10)})
    for _ in range(level):
        step = defaultdict(float)
        for (s, total), p in joint.items():
            for x in range(10):
                step[probe.bounce(s, x), total + x] += p / 10
        joint = step
    return joint


def _best_from_sum(level):
    """Accuracy of the Bayes guess from the plain sum of the operands and the tens digit."""
    mass = defaultdict(lambda: np.zeros(10))
    for (s, total), p in _value_and_sum(level).items():
        mass[total, s // 10][s % 10] += p
    return sum(v.max() for v in mass.values())


def _chance(level):
    p = _state_after(level)
    return sum(max(p[t * 10 : t * 10 + 10]) for t in range((STATES + 9) // 10))


# Exact accuracies on the labelled units digit at levels 5, 6, 7 (docs/probes.md's v6 table).
EXACT_HIGH = {
    "tens digit only (chance)": (0.1688, 0.1689, 0.1689),
    "best from the last operand": (0.2314, 0.2316, 0.2317),
    "best from the last 2 operands": (0.2748, 0.2758, 0.2760),
    "best from the last 3 operands": (0.3073, 0.3093, 0.3101),
    "best from the sum": (0.3985, 0.3653, 0.3473),
}


def _ceilings(level):
    return {"tens digit only (chance)": _chance(level),
            "best from the last operand": _best_from_last(level, 1),
            "best from the last 2 operands": _best_from_last(level, 2),
            "best from the last 3 operands": _best_from_last(level, 3),
            "best from the sum": _best_from_sum(level)}


def _enumerated(level):
    """Every input of a level (10^(level+1) rows of digits) and its result, vectorised."""
    inputs = np.indices((10,) * (level + 1)).reshape(level + 1, -1).T
    value = inputs[:, 0].copy()
    for i in range(1, level + 1):
        total = value + inputs[:, i]
        value = np.where(total <= probe.BOUNCE_LIMIT, total, np.abs(value - inputs[:, i]))
    return inputs, value


def _enumerated_bayes(keys, results):
    """The Bayes accuracy of guessing the units digit from an integer key per input and the tens digit."""
    cells = np.bincount((keys * 2 + results // 10) * 10 + results % 10, minlength=(keys.max() + 1) * 20)
    return cells.reshape(-1, 10).max(1).sum() / len(results)


@pytest.mark.parametrize("level", [3, 5])
def test_the_dynamic_programme_equals_enumeration(level):
    """The DP ceilings equal brute force over all 10^(level+1) inputs, at level 5 (10^6, pinned below) too."""
    inputs, results = _enumerated(level)
    suffix = lambda m: inputs[:, level + 1 - m :] @ (10 ** np.arange(m)[::-1])  # noqa: E731
    dp = _ceilings(level)
    for m, name in [(1, "best from the last operand"), (2, "best from the last 2 operands"),
                    (3, "best from the last 3 operands")]:
        assert dp[name] == pytest.approx(_enumerated_bayes(suffix(m), results), abs=1e-9), name
    assert dp["best from the sum"] == pytest.approx(_enumerated_bayes(inputs.sum(1), results), abs=1e-9)
    assert dp["tens digit only (chance)"] == pytest.approx(_enumerated_bayes(0 * results, results), abs=1e-9)
    assert _sum_units_rate(level) == pytest.approx(np.mean(inputs.sum(1) % 10 == results % 10), abs=1e-9)


def test_high_level_shortcut_ceilings_are_their_pinned_exact_values():
    """No suffix of three operands, nor the sum, gives more than 0.40 at levels 5-7: a model above that
    applies the earlier steps too."""
    for level in (5, 6, 7):
        for name, value in _ceilings(level).items():
            assert value == pytest.approx(EXACT_HIGH[name][level - 5], abs=5e-5), (name, level, value)
            assert value < 0.40


def _sum_units_rate(level):
    """P(the sum's units digit is the result's units digit), exactly."""
    return sum(p for (s, total), p in _value_and_sum(level).items() if s % 10 == total % 10)


def test_shortcuts_in_the_data_match_their_exact_expectation():
    """The sum's units digit measured on the generated segments (~375 per level: s.e. <= 0.026), within
    0.08 of its exact rate, which the DP gives (and which enumeration confirms at level 3)."""
    assert _sum_units_rate(3) == pytest.approx(0.3526, abs=5e-5)  # test_probe_bounce's exhaustive value
    hits, total = Counter(), Counter()
    for level, operands, result in _segments():
        total[level] += 1
        hits[level] += sum(operands) % 10 == result % 10
    for level in (5, 6, 7):
        assert hits[level] / total[level] == pytest.approx(_sum_units_rate(level), abs=0.08), level


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_v6_is_v5s_family_with_its_own_version_and_cache_name():
    assert probe.version(TASK) == "v6" and probe.TASKS[TASK] == ("bounce",)
    assert probe.ProbeCorpus(TASK).fingerprint() != probe.ProbeCorpus("probe-v5/bounce").fingerprint()


def test_cli_trains_on_v6_and_reports_its_eight_levels(tmp_path, one_thread):
    """Eight levels by default on this dataset (no --callbacks.probe_levels given)."""
    from tests.conftest import brief_probe_run

    report = brief_probe_run(TASK, tmp_path, "--callbacks.probe_hard_from", "5")
    levels = {int(k) for k in report["families"]["bounce"]}  # the few validation blocks of a tiny corpus
    assert (report["n_levels"], report["hard_from"]) == (8, 5) and levels <= set(range(8)) and max(levels) > 4


def test_v6_with_fewer_than_eight_levels_is_refused_before_the_first_step(tmp_path, one_thread, monkeypatch):
    """At an explicit 5 levels the labels 5-7 are refused at fit start, not after val_every steps: the second
    line behind the check from the dataset's name (tests/test_bad_inputs.py), which is switched off here."""
    import torch

    from experiments import run
    from tests.conftest import TINY_RUN

    def no_step(*args, **kwargs):
        raise AssertionError("an optimiser step ran before the levels were checked")

    monkeypatch.setattr(torch.optim.AdamW, "step", no_step)
    monkeypatch.setattr(run, "check_probe_levels", lambda name, levels: None)
    main = run.main
    with pytest.raises(Exception, match=r"callbacks\.probe_levels: the data's labels use levels 0\.\.7, more than the 5 "
                                        r"given; raise it to 8 or drop it"):
        main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
              str(tmp_path / "c"), "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path),
              *TINY_RUN, "--model.block_size", "128", "--callbacks.probe_blocks", "16",
              "--callbacks.probe_levels", "5"])
