"""``probe-v7/shift``: a copy at fixed positions (level 0) and a copy at a fixed distance from a source whose
position is drawn per episode (level 1) (datamodules/probe.py).

A reading by absolute position, which one layer learns on every probe here, answers level 0 and not level 1:
the level-1 copy is a read relative to the reader's own position. The tests pin the layout and what cheaper
readings get on level 1: an absolute position (under 0.1), and the source's letters read as a bag, without their
order (exactly 0.180)."""
from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction

import pytest

from datamodules import probe
from tests.conftest import brief_probe_run, probe_texts, solved_level_counts

TASK = "probe-v7/shift"
EPISODES = 400
LETTERS = probe.SHIFT_LETTERS


def _episodes(count=EPISODES):
    return probe_texts(TASK, count)


def _copy_start(levels):
    return levels.index(1)


# ---------------------------------------------------------------------------- generator vs brute force
def test_the_solver_re_derives_every_label():
    seen = solved_level_counts(TASK, EPISODES)
    assert seen == {0: EPISODES * probe.SHIFT_PREFIX, 1: EPISODES * LETTERS}


def test_the_solver_catches_a_wrong_letter_and_refuses_a_broken_layout():
    _, (data, levels) = probe.episode(TASK, 0)
    i = _copy_start(levels) + 5
    wrong = data[:i] + (b"a" if data[i:i + 1] != b"a" else b"b") + data[i + 1:]
    assert probe.solve_episode("shift", wrong, "v7")[i] != (wrong[i], 1)  # what the byte should be
    with pytest.raises(ValueError, match="does not open with"):
        probe.solve_episode("shift", b"x" + data[1:], "v7")
    second = data.index(b"|", 2 * probe.SHIFT_PREFIX + 2)
    with pytest.raises(ValueError, match="not distinct lowercase"):
        probe.solve_episode("shift", data[:second - 1] + data[second - 2:second - 1] + data[second:], "v7")


def test_level_0_sits_at_fixed_positions_and_level_1_at_a_fixed_distance_from_its_source():
    k = probe.SHIFT_PREFIX
    for text, levels in _episodes():
        assert [i for i, level in enumerate(levels) if level == 0] == list(range(k + 1, 2 * k + 1))
        assert all(text[i] == text[i - k - 1] for i in range(k + 1, 2 * k + 1))
        start = _copy_start(levels)
        assert [i for i, level in enumerate(levels) if level == 1] == list(range(start, start + LETTERS))
        source = text[start - LETTERS - 1:start - 1]
        assert text[start:start + LETTERS] == source and len(set(source)) == LETTERS and text[start - 1] == "|"


# ---------------------------------------------------------------------------- no cheaper reading
def test_the_copy_has_no_fixed_position():
    """The copy's first position is spread over 60+ values, the most frequent under a twentieth of the episodes."""
    starts = Counter(_copy_start(levels) for _, levels in _episodes())
    assert len(starts) >= 60 and max(starts.values()) < 0.05 * EPISODES


def test_the_best_absolute_position_guess_stays_near_chance():
    """The best guess from absolute positions alone (for each labelled position, its most frequent letter over
    the data; an upper bound, fitted on the very episodes it scores) is right on under 0.1 of the level-1 letters."""
    by_position = {}
    for text, levels in _episodes():
        for i in (i for i, level in enumerate(levels) if level == 1):
            by_position.setdefault(i, Counter())[text[i]] += 1
    total = sum(sum(c.values()) for c in by_position.values())
    assert sum(max(c.values()) for c in by_position.values()) / total < 0.1


def test_the_best_guess_from_the_source_letters_without_their_order():
    """A reader that sees which letters the source holds but not where, and the copy so far, can only pick one of
    the letters not yet copied. The source's 20 letters are distinct (pinned above), so the k-th labelled letter has
    exactly 20 - k candidates and the ceiling is H_20 / 20 = 0.180 (chance over the alphabet: 1/26 to 1/7)."""
    exact = sum(Fraction(1, LETTERS - k) for k in range(LETTERS)) / LETTERS
    assert abs(float(exact) - 0.1799) < 1e-4
    for text, levels in _episodes(50):  # the premise: no letter of the source repeats, so no candidate drops twice
        start = _copy_start(levels)
        assert len(set(text[start:start + LETTERS])) == LETTERS


# ---------------------------------------------------------------------------- the corpus and the CLI
def test_v7_is_its_own_family_version_and_cache_name():
    assert probe.version(TASK) == "v7" and probe.TASKS[TASK] == ("shift",) and probe.FAMILIES.index("shift") == 6
    assert probe.level_count(TASK) == 2
    assert len({probe.ProbeCorpus(task).fingerprint() for task in probe.TASKS}) == len(probe.TASKS)


def test_cli_trains_on_v7_with_its_two_levels_by_default(tmp_path, one_thread):
    report = brief_probe_run(TASK, tmp_path)
    assert (report["n_levels"], report["hard_from"]) == (2, 1)
    assert {int(k) for k in report["families"]["shift"]} == {0, 1}


def test_a_resume_that_would_measure_the_probe_otherwise_is_refused(tmp_path, one_thread):
    """The probe callback's levels, hard threshold and blocks travel in the checkpoint: a resume under others
    (here an explicit 3 levels) is refused before config.yaml is rewritten, naming the options to give; the
    same settings resume."""
    from architectures.config import ConfigError
    from experiments.run import main
    from tests.conftest import TINY_RUN

    common = ["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir", str(tmp_path / "c"),
              "--val_every", "2", "--log_dir", str(tmp_path), "--version", "r", *TINY_RUN, "--model.block_size", "128",
              "--callbacks.probe_blocks", "16"]
    run_dir = main([*common, "--max_steps", "2"])
    config, ckpt = (run_dir / "config.yaml").read_text(), str(run_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError, match=r"^ckpt_path: the run measured its probe metrics with other settings: "
                                          r"callbacks\.probe_levels \(2 in the checkpoint, 3 now\); resume with "
                                          r"--callbacks\.probe_levels 2 --callbacks\.probe_hard_from 1 "
                                          r"--callbacks\.probe_blocks 16, or start a new run$"):
        main([*common, "--max_steps", "4", "--callbacks.probe_levels", "3", "--ckpt_path", ckpt])
    assert (run_dir / "config.yaml").read_text() == config
    resumed = main([*common, "--max_steps", "4", "--ckpt_path", ckpt])
    assert json.loads((resumed / "probe.json").read_text())["step"] == 4
